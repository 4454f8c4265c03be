"""Where metrics go: `<workdir>/metrics.jsonl`, TensorBoard `<workdir>/tb/`, and the console
(a tqdm progress bar on a terminal, plain periodic lines otherwise). Only process 0 writes."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from trainer.errors import TrainingError

SHOWN_DAMAGED_LINES = 5  # a damaged file's one line names this many line numbers, then a count


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
            damage = _truncate_after(path, start_step)
            self._jsonl = open(path, "a", buffering=1)  # noqa: SIM115
        except OSError as err:
            raise TrainingError(
                f"cannot write {path}: {err.strerror}; make it writable, or choose another "
                "run.workdir"
            ) from None
        if damage is not None:
            self.message(f"warning: {damage}; dropped from the resumed log")
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
        rows = read_metrics(Path(workdir) / "metrics.jsonl").rows
    except OSError:
        return None
    return next((row[key] for row in reversed(rows) if key in row), None)


@dataclass(frozen=True)
class LoggedRow:
    """One whole metrics line: its number in the file (from 1), its text, and its row."""

    number: int
    text: str
    row: dict[str, Any]


@dataclass(frozen=True)
class MetricsLog:
    """A metrics.jsonl as read: its whole rows, and the numbers of the lines that are no row.
    A cut-off last line (a run killed mid-write) is neither: it is expected, and left out."""

    path: Path
    lines: list[LoggedRow]
    damaged: list[int]

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [line.row for line in self.lines]

    def damage(self) -> str | None:
        """One line naming the damaged lines (None without any)."""
        if not self.damaged:
            return None
        shown = ", ".join(str(n) for n in self.damaged[:SHOWN_DAMAGED_LINES])
        if len(self.damaged) > SHOWN_DAMAGED_LINES:
            shown += f" and {len(self.damaged) - SHOWN_DAMAGED_LINES} more"
        if len(self.damaged) == 1:
            what = f"line {shown} is not a metrics row"
        else:
            what = f"lines {shown} are not metrics rows"
        return f"{self.path}: {what} (a JSON object with an integer step)"


def read_metrics(path: str | Path) -> MetricsLog:
    """The one reader of metrics.jsonl (resume, report, benchmarks). Raises OSError where the
    file cannot be read; bytes that are not UTF-8 only damage their line."""
    path = Path(path)
    return _parse_metrics(path, path.read_text(errors="replace"))


def _parse_metrics(path: Path, text: str) -> MetricsLog:
    """Every line a row, a blank line or damage; the last line, when the file does not end with
    a newline, was cut off unless it is a whole row (only its newline missing)."""
    *ended, last = text.split("\n")  # `last` is "" when the file ends with a newline
    lines, damaged = [], []
    for number, line in enumerate(ended, start=1):
        row = _metrics_row(line)
        if row is not None:
            lines.append(LoggedRow(number, line, row))
        elif line.strip():
            damaged.append(number)
    row = _metrics_row(last)
    if row is not None:
        lines.append(LoggedRow(len(ended) + 1, last, row))
    return MetricsLog(path, lines, damaged)


def _metrics_row(line: str) -> dict[str, Any] | None:
    """The row a line holds: a JSON object with an integer `step`, as `MetricsWriter` writes."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # not JSON; or brackets nested past Python's stack
        return None
    return row if isinstance(row, dict) and type(row.get("step")) is int else None


def _truncate_after(path: Path, step: int) -> str | None:
    """On resume, drop what a killed run logged past its last checkpoint (and a half-written
    last line, and damaged lines), so metrics.jsonl reads as one uninterrupted run. The file is
    replaced whole, and only when it changes: a run killed meanwhile loses none of the lines it
    kept. Returns the damage dropped, as one line (None without any)."""
    if not path.exists():
        return None
    try:
        text = path.read_text(errors="replace")
    except OSError as err:  # told apart from a write's: making it writable would not do
        raise TrainingError(
            f"cannot read {path} to resume its log: {err.strerror}; make it a readable file, "
            "or choose another run.workdir"
        ) from None
    log = _parse_metrics(path, text)
    kept = "".join(line.text + "\n" for line in log.lines if line.row["step"] <= step)
    if kept != text:
        partial = path.with_name(path.name + ".partial")
        partial.write_text(kept)
        os.replace(partial, path)
    return log.damage()


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)
