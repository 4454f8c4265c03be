"""`python -m trainer.report WORKDIR [WORKDIR ...] [--out PATH]`: see a run, or compare runs.

Reads each workdir's `metrics.jsonl` (and `summary.json` when the run finished), draws one PNG
(train and eval loss, learning rate, tokens/s, data wait fraction, step time, and where the time
went; runs overlaid, labelled by `run.name`, or by workdir name where that is the default) and
prints a few lines per run. Headless: matplotlib's Agg backend, no display needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainer.config import RunConfig
from trainer.observe.goodput import BUCKETS
from trainer.observe.metrics import read_metrics

USAGE_EXIT = 2
ANOTHER_WORKDIR = "pass the run.workdir of a run that logged a step"
DEFAULT_NAME = RunConfig().name  # says nothing about the run: the folder name does
CURVES = (  # metrics.jsonl key, panel title
    ("lr", "learning rate"),
    ("tokens_per_s", "tokens/s"),
    ("data_wait_frac", "data wait fraction"),
    ("step_time_s", "step time (s)"),
)


class ReportError(ValueError):
    """A workdir the report cannot read: the message names it and the fix."""


@dataclass
class RunLog:
    """One run's logged rows: train lines (with `loss`) and eval lines (with `eval_loss`)."""

    label: str
    workdir: Path
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    summary: dict[str, Any] | None
    damage: str | None = None  # the damaged lines skipped, as one line

    def series(self, key: str) -> tuple[list[int], list[float]]:
        rows = [r for r in self.train if key in r]
        return [r["step"] for r in rows], [_number(r[key]) for r in rows]


def _number(value: Any) -> float:
    """metrics.jsonl writes NaN/Inf as strings (JSON has neither)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def run_name(workdir: str | Path) -> str:
    """The run's label: `run.name` from its saved `config.yaml` unless left at the default
    ("run", which says nothing), else the workdir's folder name: also where that file cannot be
    read, or is not a run's config (a label is no reason to refuse the report)."""
    workdir = Path(workdir)
    try:
        config = yaml.safe_load((workdir / "config.yaml").read_text(encoding="utf-8"))
        name = config["run"]["name"]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, TypeError, KeyError):
        name = None
    return name if isinstance(name, str) and name and name != DEFAULT_NAME else workdir.name


def load_run(workdir: str | Path, label: str) -> RunLog:
    workdir = Path(workdir)
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{_no_metrics_file(workdir, path)}; {ANOTHER_WORKDIR}")
    try:
        log = read_metrics(path)
    except OSError as err:
        raise ReportError(
            f"cannot read {path} ({err.strerror}); make it readable, or {ANOTHER_WORKDIR}"
        ) from None
    train = [r for r in log.rows if "loss" in r]
    if not log.rows and log.damaged:
        raise ReportError(
            f"{path} holds no metrics line (a JSON object with step and loss); {ANOTHER_WORKDIR}"
        )
    if not train:
        raise ReportError(f"{path} holds no training lines yet; wait for the first log.every step")
    return RunLog(
        label=label,
        workdir=workdir,
        train=train,
        evals=[r for r in log.rows if "eval_loss" in r],
        summary=_read_summary(workdir / "summary.json"),
        damage=log.damage(),
    )


def _no_metrics_file(workdir: Path, path: Path) -> str:
    """Why `path`, the metrics file of `workdir`, is not a file to read."""
    if not workdir.exists():
        return f"{workdir} does not exist"
    if path.is_symlink() and not path.exists():
        return f"{path} is a link to {os.readlink(path)}, which leads to no file"
    if path.exists():
        return f"{path} is not a file"
    return f"{workdir} has no metrics.jsonl"


def _read_summary(path: Path) -> dict[str, Any] | None:
    """The last finished session's summary; None while running, or if unreadable or not in the
    shape a run writes (numbers for `wall_s` and each of `fractions`)."""
    try:
        summary = json.loads(path.read_text(errors="replace"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(summary, dict):
        return None
    fractions = summary.get("fractions", {})
    numbers = [
        summary.get("wall_s", 0),
        *(fractions.values() if isinstance(fractions, dict) else [None]),
    ]
    return summary if all(_is_number(v) for v in numbers) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def load_runs(workdirs: list[str | Path]) -> list[RunLog]:
    """Runs labelled by `run_name`, or by workdir path where two labels collide."""
    paths = [Path(w) for w in workdirs]
    names = [run_name(p) for p in paths]
    return [
        load_run(p, n if names.count(n) == 1 else str(p)) for p, n in zip(paths, names, strict=True)
    ]


def text_summary(run: RunLog) -> str:
    last = run.train[-1]
    steady = run.train[1:] or run.train  # the first logged step paid for the compile
    speeds = [_number(r["tokens_per_s"]) for r in steady if "tokens_per_s" in r]
    lines = [f"{run.label}: {last['step']} steps, final loss {_number(last['loss']):.4f}"]
    if run.evals:
        best = min(run.evals, key=lambda r: _number(r["eval_loss"]))
        lines.append(f"  best eval loss {_number(best['eval_loss']):.4f} at step {best['step']}")
    if speeds:
        lines.append(f"  mean tokens/s {sum(speeds) / len(speeds):.4g}")
    if run.summary:
        shares = run.summary.get("fractions", {})
        text = ", ".join(f"{k} {100 * shares[k]:.0f}%" for k in BUCKETS if k in shares)
        lines.append(f"  time (last session, {run.summary.get('wall_s', 0):.0f} s): {text}")
    return "\n".join(lines)


def render(runs: list[RunLog], out: str | Path) -> Path:
    """Draw every run into one PNG at `out`."""
    import matplotlib

    matplotlib.use("Agg")  # headless: CI, Slurm, ssh
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    loss_ax, *curve_axes, share_ax = axes.flat
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        loss_ax.plot(*run.series("loss"), color=color, label=f"{run.label} train")
        if run.evals:
            steps = [r["step"] for r in run.evals]
            losses = [_number(r["eval_loss"]) for r in run.evals]
            loss_ax.plot(steps, losses, "o--", color=color, label=f"{run.label} eval")
        for ax, (key, _) in zip(curve_axes, CURVES, strict=True):
            ax.plot(*run.series(key), color=color, label=run.label)
    loss_ax.set_title("loss")
    loss_ax.legend(fontsize="small")
    for ax, (_, title) in zip(curve_axes, CURVES, strict=True):
        ax.set_title(title)
    for ax in axes.flat[:-1]:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    _draw_shares(share_ax, runs, plt)
    out = image_path(out, fig.canvas.get_supported_filetypes())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    except OSError as err:
        reason = "a parent is a file" if isinstance(err, FileExistsError) else err.strerror
        raise ReportError(f"cannot write {out} ({reason}); pass --out a writable path") from None
    finally:
        plt.close(fig)
    return out


def image_path(out: str | Path, formats: dict[str, str]) -> Path:
    """Where the image goes: `out`, `out/report.png` for a folder, `out.png` without a suffix
    (as matplotlib itself would write it); an unknown suffix is a one-line error."""
    out = Path(out)
    if out.is_dir():
        return out / "report.png"
    if not out.suffix:
        return out.with_suffix(".png")
    if out.suffix[1:].lower() not in formats:
        raise ReportError(
            f"--out {out}: matplotlib cannot write {out.suffix} files; use .png (or one of "
            f"{', '.join(sorted(formats))})"
        )
    return out


def _draw_shares(ax, runs: list[RunLog], plt) -> None:
    """Stacked bars: each run's last session split into the goodput buckets."""
    ax.set_title("where the time went (summary.json)")
    finished = [r for r in runs if r.summary and "fractions" in r.summary]
    if not finished:
        ax.text(0.5, 0.5, "no summary.json yet", ha="center", va="center")
        ax.set_axis_off()
        return
    colors = plt.get_cmap("tab10").colors
    for j, bucket in enumerate(BUCKETS):
        left = [sum(r.summary["fractions"].get(b, 0.0) for b in BUCKETS[:j]) for r in finished]
        width = [r.summary["fractions"].get(bucket, 0.0) for r in finished]
        ax.barh([r.label for r in finished], width, left=left, color=colors[j], label=bucket)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of wall time")
    ax.legend(fontsize="small", ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.report",
        description="Plot and summarize runs from their workdirs' metrics.jsonl.",
    )
    parser.add_argument("workdirs", nargs="+", help="run.workdir of one or more runs")
    parser.add_argument("--out", help="PNG to write (default: <first workdir>/report.png)")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.workdirs)
        for run in runs:
            if run.damage is not None:
                print(f"warning: {run.damage}; skipped", file=sys.stderr)
            print(text_summary(run))
        out = render(runs, args.out or Path(args.workdirs[0]) / "report.png")
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
