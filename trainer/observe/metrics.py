"""Where metrics go: `<workdir>/metrics.jsonl`, TensorBoard `<workdir>/tb/`, and the console
(a tqdm progress bar on a terminal, plain periodic lines otherwise). Only process 0 writes."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from trainer.errors import TrainingError


def _jsonable(value: Any) -> Any:
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep the line parseable
    return value


class MetricsWriter:
    """One object per run; `write(step, metrics)` sends a metrics line to every sink."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        progress: bool = True,
        enabled: bool = True,
        stream: TextIO | None = None,
    ):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._total = total_steps
        self._pace: tuple[float, int] | None = None  # (time, step) of the first line: ETA base
        if not enabled:
            return
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "metrics.jsonl"
        try:
            _truncate_after(path, start_step)
            self._jsonl = open(path, "a", buffering=1)  # noqa: SIM115
        except OSError as err:
            raise TrainingError(
                f"cannot write {path}: {err.strerror}; make it writable, or choose another "
                "run.workdir"
            ) from None
        if tensorboard:
            from tensorboardX import SummaryWriter  # no TensorFlow import needed

            self._tb = SummaryWriter(str(workdir / "tb"))
        if progress and self.stream.isatty():
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                file=self.stream,
                dynamic_ncols=True,
            )

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
        self._console(step, row)

    def _console(self, step: int, row: dict[str, Any]) -> None:
        """A line (or the bar's postfix) for rows with a key the console shows; the others (a
        checkpoint's `ckpt_block_s`) only move the bar."""
        shown = {k: row[k] for k in ("loss", "eval_loss", "tokens_per_s", "lr") if k in row}
        if row.get("skipped_steps"):  # a run skipping steps (float16 overflows) says so
            shown["skipped_steps"] = row["skipped_steps"]
        text = " ".join(f"{k}={_short(v)}" for k, v in shown.items())
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
        if not shown:
            return
        if self._bar is not None:
            if "loss" in row:
                self._bar.set_postfix_str(text, refresh=True)
            else:
                self._bar.write(f"step {step}: {text}", file=self.stream)
        else:
            if "loss" in row:
                text += f" eta={self._eta(step, row.get('step_time_s'))}"
            print(f"step {step}: {text}", file=self.stream, flush=True)

    def _eta(self, step: int, step_time_s: Any) -> str:
        """Remaining time at the pace since the first line (which paid for the compile); on the
        first line, at the pace of its own step."""
        now = time.perf_counter()
        self._pace = self._pace or (now, step)
        if step > self._pace[1]:
            per_step = (now - self._pace[0]) / (step - self._pace[1])
        elif isinstance(step_time_s, int | float):
            per_step = step_time_s
        else:
            return "?"
        return _duration(per_step * max(self._total - step, 0))

    def text(self, step: int, tag: str, text: str) -> None:
        """A piece of text in TensorBoard's Text tab (e.g. a sampled continuation)."""
        if self._tb is not None:
            self._tb.add_text(tag, text, step)

    def message(self, text: str) -> None:
        """A log line that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)  # tqdm's default is stdout
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def last_logged(workdir: str | Path, key: str) -> Any:
    """`key`'s value in the newest metrics line that has it (None without one): where a running
    total such as `skipped_steps` goes on from when a run resumes."""
    try:
        lines = (Path(workdir) / "metrics.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and key in row:
            return row[key]
    return None


def _truncate_after(path: Path, step: int) -> None:
    """On resume, drop what a killed run logged past its last checkpoint (and a half-written
    last line), so metrics.jsonl reads as one uninterrupted run. The file is replaced whole, and
    only when a line goes: a run killed meanwhile loses none of the lines it kept."""
    if not path.exists():
        return
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    kept = [line for line in lines if _logged_by_step(line, step)]
    if len(kept) == len(lines):
        return
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)


def _logged_by_step(line: str, step: int) -> bool:
    """Whether `line` is a whole metrics row of `step` or before."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return False
    return line.endswith("\n") and isinstance(row, dict) and row.get("step", 0) <= step


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)
