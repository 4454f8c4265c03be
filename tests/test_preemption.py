"""A SIGTERM outside the step loop raises `Stopped` wherever the main thread is. Where Python can
only swallow that exception (a garbage-collector callback, a `__del__`), the run must still stop,
without printing the swallowed traceback: in CI the signal once landed in JAX's gc callback during
start-up, and the run trained and finished instead."""

import gc
import signal
import sys

import pytest

from trainer.preemption import OutsideLoop, Stopped, StopRequest


class _SignalsWhenCollected:
    """Raises SIGTERM from its `__del__`, where Python reports an exception and goes on."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGTERM)


def _swallowed_sigterm() -> None:
    _SignalsWhenCollected()  # dropped at once: its __del__ runs here
    gc.collect()


def test_a_stop_swallowed_during_start_up_stops_the_run_before_its_first_step(capsys):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as stopped, OutsideLoop(single_process=True):
        _swallowed_sigterm()
        with StopRequest():
            pytest.fail("the loop started after a SIGTERM")
    assert not stopped.value.loop_started
    assert stopped.value.line().startswith("stopped by SIGTERM during start-up")
    assert "Traceback" not in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before  # and no handler of ours is left


def test_a_stop_swallowed_while_closing_says_so():
    with pytest.raises(Stopped) as stopped, OutsideLoop(single_process=True):
        with StopRequest():
            pass
        _swallowed_sigterm()
    assert stopped.value.loop_started
    assert "while closing the run" in stopped.value.line()


def test_other_swallowed_exceptions_are_still_reported():
    seen = []
    previous = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        with OutsideLoop(single_process=True):

            class _Fails:
                def __del__(self) -> None:
                    raise ValueError("not ours")

            _Fails()
            gc.collect()
    finally:
        sys.unraisablehook = previous
    assert [type(s.exc_value) for s in seen] == [ValueError]


def test_several_processes_leave_sigterm_alone():
    before = signal.getsignal(signal.SIGTERM)
    with OutsideLoop(single_process=False):
        assert signal.getsignal(signal.SIGTERM) is before
