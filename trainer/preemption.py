"""Clean stops: the first SIGTERM or SIGINT asks the loop to finish the current step, save, and
exit 0; a second SIGINT aborts at once (KeyboardInterrupt), unless that save has begun: then it
says so and lets the save finish (`saving_last`). A single process waiting for a batch stops at
once, saving the last completed step (`at_wait`).

With several processes, every one must stop after the same step: a host that alone saw the
signal would save and leave while the others wait for it in the next collective, forever. So
there SIGTERM is left to JAX's preemption service (`jax.distributed` installs its handler), which
tells every process the same step to stop at; SIGINT is turned into a SIGTERM to join it.

Outside the loop (start-up: data, model, compile, restore; and closing after it) nothing is being
trained, so a single process's SIGTERM ends the run at once with one line (`OutsideLoop`), through
its cleanups: its default action killed it mid-way, without a word (a half-prepared built-in
corpus stayed behind in the cache). A SIGINT once the loop has ended with its saves written ends
the run the same way, with a line saying that its checkpoints are complete: Python's own
KeyboardInterrupt there made the CLI say that nothing was saved. Python swallows an exception
raised where it cannot propagate (a garbage-collector callback, a `__del__`), so a stop raised
there is kept and raised again when the loop would start, or when the run closes. Several
processes get the same line while they have not yet joined JAX's runtime (a Slurm time-limit
warning during start-up, a SIGTERM to launch/local.sh): once joined, JAX's preemption service
holds SIGTERM and stops them all after their first step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
from jax.experimental import multihost_utils

from trainer.errors import exit_now, say_now


class StopRequest:
    """A context manager that turns termination signals into a decision the loop takes once per
    step (`at_step`), identical on every process."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.requested = False  # the loop decided (at the last `at_step`) to save and stop
        self._multihost = jax.process_count() > 1
        self._asked = 0  # this session's questions to JAX's sync point: 1, 2, ... per step
        self._previous: dict[int, object] = {}
        self._saving_step: int | None = None  # the stop's own save has begun (`saving_last`)
        self._said_finishing = False
        self._outside: OutsideLoop | None = None  # the CLI's handler of signals outside the loop

    def at_step(self) -> bool:
        """Decide whether the step just run is the last one; call it exactly once per step on
        every process. With several, it is the only caller of JAX's sync point, whose count of
        each process's latest step must never go back (`trainer.checkpoint.manager._Manager` keeps
        Orbax's away). The count is this session's steps, not the run's: JAX stops one past the
        furthest count, and counts 0 before the first question, so a notice during a resumed
        run's start-up named step 1, which a loop that starts at step 4 never reaches."""
        if self.requested:
            return True
        if self._multihost:
            self._asked += 1  # every process resumes from the same step: the counts agree
            self.requested = multihost_utils.reached_preemption_sync_point(self._asked)
            if self.requested and self.signal_name is None:
                self.signal_name = "SIGTERM"  # seen by JAX's notifier here or on another host
        else:
            self.requested = self.signal_name is not None
        return self.requested

    def at_wait(self) -> bool:
        """Decide, while the loop waits for training or eval data, whether to stop now. Only a
        single process may: several stop at a step they all agree on (`at_step`), so there a
        wait on a source that never returns is left to the watchdog (`run.step_timeout_s`)."""
        if self._multihost:
            return False  # each host would give up its wait at another moment
        self.requested = self.signal_name is not None
        return self.requested

    def saving_last(self, step: int) -> None:
        """The loop begins the stop's save, of `step` (its last act): a second SIGINT from now on
        lets it finish. Raised in the middle of Orbax's save, its KeyboardInterrupt left a partial
        save and Orbax's tracebacks at exit; once the save was being written, closing the run
        waited for it anyway, and then said that nothing was saved."""
        self._saving_step = step

    def _handle(self, signum: int, _frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            self._second_sigint()
            return
        self.signal_name = signal.Signals(signum).name
        if self._multihost:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier

    def _second_sigint(self) -> None:
        """Abort at once, without saving; or, once the stop's save has begun, say (once) that it
        is finishing, and how to abandon it."""
        if self._saving_step is None:
            raise KeyboardInterrupt("second SIGINT: aborting without saving")
        if not self._said_finishing:
            self._said_finishing = True
            say_now(
                f"SIGINT again: the checkpoint of step {self._saving_step} is being saved; the "
                "run stops once it is complete (killing the process abandons it: the next run "
                "then resumes from the checkpoint before)"
            )

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals need the main thread
            self._outside = _outside_loop()
            if self._outside is not None:
                self._outside.raise_swallowed()  # a start-up stop that Python swallowed
                self._outside.loop_started = True  # a signal after this loop comes while closing
            handled = (signal.SIGINT,) if self._multihost else (signal.SIGTERM, signal.SIGINT)
            for sig in handled:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if self._outside is not None and exc_type is None:  # before a SIGINT can reach it
            self._outside.saves_written = True  # the loop waited for its saves before it ended
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _outside_loop() -> OutsideLoop | None:
    """The `OutsideLoop` around this run, found by the signal handlers it holds (None without
    one: a library caller's own loop)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        outside = getattr(signal.getsignal(sig), "__self__", None)
        if isinstance(outside, OutsideLoop):
            return outside
    return None


class Stopped(BaseException):
    """A SIGTERM outside the step loop, or a SIGINT after it: raised where the main thread is, so
    that cleanups run. A `BaseException`, like `KeyboardInterrupt`, so that no `except Exception`
    swallows it."""

    def __init__(self, signal_name: str, loop_started: bool, joining: str | None = None) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.loop_started = loop_started
        self.joining = joining  # the cluster this process was joining, e.g. "the cluster at ..."

    def line(self) -> str:
        """What the stop says: as the loop's stop line, whether anything is lost and what next."""
        if self.loop_started:  # the loop's saves were all written before it returned
            return (
                f"stopped by {self.signal_name} while closing the run, after its last step; its "
                "checkpoints are complete: re-run the same command to resume"
            )
        where = f", while joining {self.joining}" if self.joining else ""
        return (
            f"stopped by {self.signal_name} during start-up, before this session's first step"
            f"{where}; nothing was trained, so nothing new is saved; re-run the same command to "
            "start (or resume from the latest checkpoint)"
        )


def stop_behind(err: BaseException) -> Stopped | KeyboardInterrupt | None:
    """The stop that `err` was raised from, if one was: a C extension module whose import a
    signal cut reports `ImportError: initialization failed`, raised from the stop. Only causes
    count: an error raised while handling a stop (in a cleanup) is an error of its own."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (Stopped, KeyboardInterrupt)):
            return err
        seen.add(id(err))
        err = err.__cause__
    return None


class OutsideLoop:
    """A context manager, held around a whole run, that turns a SIGTERM while no `StopRequest`
    holds it into the end of the run with one line. SIGINT keeps its `KeyboardInterrupt` (nothing
    new is saved) until the loop has ended with its saves written (`saves_written`); from then it
    is a stop while closing, as a SIGTERM (a SIGINT that Python ignores stays ignored).

    A single process raises `Stopped` where its main thread is, so that its cleanups run. Several
    processes do so only until they have joined JAX's runtime (`runtime_joined`): from then on
    JAX's preemption service holds SIGTERM and stops them all after the same step, where one that
    left alone would keep the others waiting for it in a collective. Before that, nothing has
    started but JAX's half-made runtime, whose exit-time shutdown waits for peers that may never
    come, so the process writes its line and ends at once (with `run.stop_exit_status`, as every
    stop); the others stop on their own SIGTERM (a launcher's or Slurm's reaches them all), or end
    when JAX's `JAX_INIT_TIMEOUT_S` gives up on it."""

    def __init__(
        self, single_process: bool, cluster: str = "the cluster", stop_status: int = 0
    ) -> None:
        self.loop_started = False  # a `StopRequest` took SIGTERM over (and gave it back)
        self.saves_written = False  # that loop ended normally, after waiting for its saves
        self._single_process = single_process
        self._cluster = cluster  # what several processes join, for the line
        self._stop_status = stop_status  # run.stop_exit_status: what ending at once exits with
        self._runtime_has_sigterm = False  # JAX's preemption service replaced our handler
        self._previous: object = None
        self._previous_sigint: object = None  # set while we hold SIGINT
        self._previous_unraisable_hook = sys.unraisablehook
        self._raised: Stopped | None = None  # kept in case Python swallowed it
        self._installed = False

    def runtime_joined(self) -> None:
        """Several processes: JAX's runtime is joined, and its preemption service has installed
        its own SIGTERM handler in place of ours (left in place when the run ends). Any thread
        may call it: the one that joined does, at once."""
        self._runtime_has_sigterm = True

    def _handle(self, signum: int, _frame) -> None:
        if self._runtime_has_sigterm:  # it came just before JAX's handler took ours over
            if not jax.config.jax_enable_preemption_service:  # none took over: as before us
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier
            return
        name = signal.Signals(signum).name
        if not self._single_process:
            line = Stopped(name, self.loop_started, joining=self._cluster).line()
            exit_now(self._stop_status, line)
        self._raised = Stopped(name, self.loop_started)
        raise self._raised

    def _handle_sigint(self, signum: int, frame) -> None:
        if not self.saves_written:
            signal.default_int_handler(signum, frame)  # KeyboardInterrupt: "without saving"
        self._raised = Stopped(signal.Signals(signum).name, loop_started=True)
        raise self._raised

    def _unraisable(self, unraisable: sys.UnraisableHookArgs) -> None:
        """Python's report of an exception it swallowed; our own stop is raised again later."""
        if not isinstance(unraisable.exc_value, Stopped):
            self._previous_unraisable_hook(unraisable)

    def raise_swallowed(self) -> None:
        """Raise again a stop that was raised where Python could only swallow it."""
        if self._raised is not None:
            raise Stopped(self._raised.signal_name, self.loop_started)

    def __enter__(self) -> OutsideLoop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous_sigint = signal.signal(signal.SIGINT, self._handle_sigint)
            self._previous_unraisable_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable
            self._installed = True
        return self

    def __exit__(self, exc_type, exc, _traceback) -> None:
        if self._installed:
            if not self._runtime_has_sigterm:  # restoring the old one would remove JAX's
                signal.signal(signal.SIGTERM, self._previous)
            if self._previous_sigint is not None:
                signal.signal(signal.SIGINT, self._previous_sigint)
                self._previous_sigint = None
            sys.unraisablehook = self._previous_unraisable_hook
            self._installed = False
            if exc_type is None:
                self.raise_swallowed()  # a stop swallowed while the run closed
            elif (stop := stop_behind(exc)) is not None and stop is not exc:
                raise stop from None  # e.g. a C extension's import turned it into an ImportError
