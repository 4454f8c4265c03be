"""Where a run's wall time goes: compile, productive steps, waiting for data, blocking on
checkpoints, eval, and the rest — the first question about any slow run, answered in numbers.

The loop wraps each phase in `goodput.timing(bucket)`. XLA compilations are found through
`jax.monitoring` time spans and moved out of whichever phase triggered them into `compile`, so a
first step that compiles for 20 s counts as compile, not as a slow step. Whatever no timer covers
(setup, logging, the profiler) is `other`. One `Goodput` per run; nothing is global.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

BUCKETS = ("compile", "step", "data_wait", "checkpoint", "eval", "other")
COMPILE_EVENTS = frozenset(
    {  # the three phases of turning a Python function into an executable (jax 0.10 to 0.12)
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
)


@dataclass
class _Frame:
    """One open `timing` block: compile spans seen inside it, seconds taken by nested blocks."""

    bucket: str
    start: float
    spans: list[tuple[float, float]] = field(default_factory=list)
    nested_s: float = 0.0


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Length of the union of intervals: a trace nested in another trace counts once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class Goodput:
    """Seconds per bucket for this process's session (a resumed run starts a new session).

    Use as a context manager to count compilations (it listens to `jax.monitoring` while open);
    without it the timers still work and compilation stays inside the phase that caused it.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._begin = clock()
        self._end: float | None = None
        self._seconds = dict.fromkeys(BUCKETS, 0.0)
        self._frames: list[_Frame] = []
        self._loose_spans: list[tuple[float, float]] = []  # compiles outside any timer
        self._thread = threading.get_ident()  # compiles on other threads overlap, not add

    def __enter__(self) -> Goodput:
        jax.monitoring.register_event_time_span_listener(self._on_span)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_time_span_listener(self._on_span)
        self._end = self._clock()

    def _on_span(self, event: str, start: float, end: float, **_: Any) -> None:
        if event not in COMPILE_EVENTS or threading.get_ident() != self._thread:
            return
        (self._frames[-1].spans if self._frames else self._loose_spans).append((start, end))

    @contextmanager
    def timing(self, bucket: str) -> Iterator[None]:
        """Count the block's wall time to `bucket` (minus compiles and nested blocks)."""
        if bucket not in BUCKETS:
            raise ValueError(f"unknown goodput bucket {bucket!r}; use one of {BUCKETS}")
        frame = _Frame(bucket, self._clock())
        self._frames.append(frame)
        try:
            yield
        finally:
            self._frames.pop()
            elapsed = self._clock() - frame.start
            own = elapsed - frame.nested_s
            compiled = min(_union_s(frame.spans), own)
            self._seconds["compile"] += compiled
            self._seconds[bucket] += own - compiled
            if self._frames:
                self._frames[-1].nested_s += elapsed

    def wall_s(self) -> float:
        return (self._end if self._end is not None else self._clock()) - self._begin

    def seconds(self) -> dict[str, float]:
        """Seconds per bucket so far (open timers count up to now); `other` is the rest."""
        now = self._clock()
        seconds = dict(self._seconds)
        seconds["compile"] += _union_s(self._loose_spans)
        for depth, frame in enumerate(self._frames):
            inner = self._frames[depth + 1].start if depth + 1 < len(self._frames) else now
            compiled = _union_s(frame.spans)
            seconds["compile"] += compiled
            seconds[frame.bucket] += max(inner - frame.start - frame.nested_s - compiled, 0.0)
        named = sum(v for k, v in seconds.items() if k != "other")
        seconds["other"] = max(self.wall_s() - named, 0.0)
        return seconds

    def metrics(self) -> dict[str, float]:
        """Cumulative fields for a metrics line: `goodput` (productive share of the wall time so
        far), `goodput_wall_s`, and `goodput_<bucket>_s`."""
        seconds, wall = self.seconds(), self.wall_s()
        row = {"goodput": seconds["step"] / wall if wall > 0 else 0.0, "goodput_wall_s": wall}
        row.update({f"goodput_{k}_s": v for k, v in seconds.items()})
        return row


def peak_memory_bytes() -> int | None:
    """Largest peak bytes in use over this host's devices; None where the backend keeps no
    statistics (CPU returns None from `memory_stats()`)."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - some plugins raise instead of returning None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def session_summary(
    goodput: Goodput,
    *,
    start_step: int,
    end_step: int,
    tokens: float,
    flops_per_token: float,
    peak_tflops: float | None,
    last_metrics: dict[str, Any],
    eval_loss: float | None,
) -> dict[str, Any]:
    """What `<workdir>/summary.json` holds: this process's session only (a resumed run reports
    the steps since it resumed), its time per bucket, throughput, MFU and peak memory."""
    seconds, wall = goodput.seconds(), goodput.wall_s()
    fractions = {k: v / wall if wall > 0 else 0.0 for k, v in seconds.items()}
    step_tokens_per_s = tokens / seconds["step"] if seconds["step"] > 0 else None
    mfu = None
    if peak_tflops and step_tokens_per_s:
        mfu = step_tokens_per_s * flops_per_token / jax.device_count() / 1e12 / peak_tflops
    return {
        "session": "this process's session only; a resumed run counts from its resume step",
        "start_step": start_step,
        "end_step": end_step,
        "steps": max(end_step - start_step, 0),
        "wall_s": wall,
        "seconds": seconds,
        "fractions": fractions,
        "goodput": fractions["step"],
        "tokens": tokens,  # what the loss averaged over: padding excluded
        "tokens_per_s": step_tokens_per_s,  # while stepping: the model's speed
        "tokens_per_s_wall": tokens / wall if wall > 0 else None,  # what the session delivered
        "mfu": mfu,
        "peak_memory_bytes": peak_memory_bytes(),
        "final_loss": last_metrics.get("loss"),
        "eval_loss": eval_loss,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run console table."""
    lines = [
        f"where the time went (steps {summary['start_step']}->{summary['end_step']} of this "
        f"session, {summary['wall_s']:.1f} s wall):"
    ]
    for bucket in BUCKETS:
        seconds, share = summary["seconds"][bucket], summary["fractions"][bucket]
        lines.append(f"  {bucket:<11} {seconds:9.2f} s  {100 * share:5.1f}%")
    tokens = summary["tokens_per_s"]
    mfu, memory = summary["mfu"], summary["peak_memory_bytes"]
    lines.append(
        f"  tokens/s {tokens:.4g} while stepping, {summary['tokens_per_s_wall']:.4g} overall"
        if tokens
        else "  tokens/s: no step completed"
    )
    lines.append(
        f"  MFU {'n/a (device peak unknown; set log.peak_tflops)' if mfu is None else f'{mfu:.1%}'}"
        f"; peak device memory {'n/a' if memory is None else f'{memory / 2**30:.2f} GiB'}"
    )
    return "\n".join(lines)


def write_summary(workdir: str | Path, summary: dict[str, Any]) -> str | None:
    """Write `<workdir>/summary.json`; a problem comes back as a warning, since the run itself
    has finished and its checkpoints are safe."""
    path = Path(workdir) / "summary.json"
    try:
        path.write_text(json.dumps(summary, indent=1) + "\n")
    except OSError as err:
        return f"warning: cannot write {path} ({err.strerror}); the run itself finished"
    return None
