"""The step watchdog: a process whose loop stops making progress (a hung collective, a data reader
blocked on a dead filesystem, a deadlock) writes its Python stacks and exits non-zero, so the
scheduler restarts the job from the latest checkpoint instead of holding every host forever.

The runtime's heartbeats catch a *dead* peer; this catches a *stuck* one, whose heartbeat thread
keeps beating. Every process runs its own: a process waiting on a stuck peer is stuck as well.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TextIO

# Auto timeout: FACTOR x the median of the first CALIBRATION_STEPS steps after the first (which
# compiles), never below FLOOR_S. Until then, and for evals and checkpoints in auto mode,
# STARTUP_S: compiles and first saves of large models take minutes.
FACTOR = 10.0
CALIBRATION_STEPS = 10
FLOOR_S = 300.0
STARTUP_S = 900.0
EXIT_STUCK = 3  # distinct from 1 (a crash) and 2 (a user error)
WAITS = {
    "data": "data (the input pipeline)",
    "step": "the device (a step)",
    "eval": "an eval",
    "checkpoint": "a checkpoint save",
    "loop": "the loop itself (between phases: stop agreement, logging)",
    "startup": "the first batch",
}


class Watchdog:
    """Progress is a completed step (`beat`) or entering a phase (`phase`); a phase that lasts
    longer than the limit trips it. Times come from `clock`, so tests can drive it."""

    def __init__(
        self,
        timeout_s: float | None,
        *,
        out: TextIO | None = None,
        on_timeout: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 1.0,
    ):
        self.timeout_s = timeout_s  # None: auto
        self.out = out
        self.on_timeout = on_timeout
        self.clock = clock
        self.poll_s = poll_s
        self.step = 0  # the step the loop is working towards
        self.last_completed: int | None = None
        self.current = "startup"
        self.since = clock()
        self.durations: list[float] = []  # seconds between this session's completed steps
        self._last_beat: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # watching while the `with` block runs

    # ---------------------------------------------------------------- what the loop calls

    def beat(self, step: int) -> None:
        """`step` finished: restart the clock, and learn the typical step time."""
        now = self.clock()
        if self._last_beat is not None and len(self.durations) < CALIBRATION_STEPS:
            self.durations.append(now - self._last_beat)
        self._last_beat, self.last_completed, self.since = now, step, now

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """What the loop waits for now (data, step, eval, checkpoint); entering it is progress."""
        self.current, self.since = name, self.clock()
        if step is not None:
            self.step = step
        try:
            yield
        finally:
            self.current, self.since = "loop", self.clock()

    # ---------------------------------------------------------------- the limit

    def limit_s(self) -> float:
        """Seconds the current phase may take before the process counts as stuck."""
        if self.timeout_s is not None:
            if self.last_completed is None:  # this session's first step compiles
                return max(self.timeout_s, STARTUP_S)
            return self.timeout_s
        if len(self.durations) < CALIBRATION_STEPS or self.current in ("eval", "checkpoint"):
            return STARTUP_S
        return max(FLOOR_S, FACTOR * statistics.median(self.durations))

    def overdue(self) -> bool:
        """The current phase has outlasted its limit."""
        return self.clock() - self.since > self.limit_s()

    # ---------------------------------------------------------------- the thread

    def __enter__(self) -> Watchdog:
        self.since = self.clock()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.overdue():
                self.trip()
                return

    def trip(self) -> None:
        """Stacks of every thread, one line saying what was stuck, then exit: a stuck collective
        cannot be interrupted by an exception, only by ending the process."""
        out = self.out or sys.stderr
        limit = self.limit_s()
        waited = self.clock() - self.since
        _dump_stacks(out)
        last = "none" if self.last_completed is None else str(self.last_completed)
        process = _process_label()
        print(
            f"error: watchdog{process}: no progress for {_seconds(waited)} s (limit "
            f"{_seconds(limit)} s, run.step_timeout_s) at step {self.step}, last completed step "
            f"{last}, waiting for {WAITS.get(self.current, self.current)}; stacks above. Exiting "
            f"with status {EXIT_STUCK} so the launcher restarts the job from the latest checkpoint",
            file=out,
            flush=True,
        )
        self.on_timeout(EXIT_STUCK)


def _dump_stacks(out: TextIO) -> None:
    """faulthandler reads the frames without the GIL; a stream without a file descriptor (a
    captured one) gets Python's own formatting instead."""
    out.flush()
    try:
        faulthandler.dump_traceback(file=out, all_threads=True)
        return
    except (AttributeError, ValueError, OSError):
        pass
    for ident, frame in sys._current_frames().items():
        print(f"Thread {ident:#x}:", file=out)
        out.write("".join(traceback.format_stack(frame)))
    out.flush()


def _process_label() -> str:
    """` (process i of n)` once JAX runs on several processes; empty otherwise."""
    jax = sys.modules.get("jax")
    try:
        count = jax.process_count() if jax is not None else 1
    except Exception:  # a runtime in a broken state must not stop the report
        return ""
    return f" (process {jax.process_index()} of {count})" if count > 1 else ""


def _seconds(value: float) -> str:
    """Whole seconds, or two significant digits below one: a 0.02 s limit is not "0 s"."""
    return f"{value:.0f}" if value >= 1 else f"{value:.2g}"
