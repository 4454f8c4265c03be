"""A SIGTERM outside the step loop raises `Stopped` wherever the main thread is. Where Python can
only swallow that exception (a garbage-collector callback, a `__del__`), the run must still stop,
without printing the swallowed traceback: in CI the signal once landed in JAX's gc callback during
start-up, and the run trained and finished instead."""

import gc
import signal
import sys
import time

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


def test_several_processes_leave_sigterm_to_jax_once_joined():
    """Until the processes joined JAX's runtime a SIGTERM is ours (it ends the process with its
    line: tests/test_multihost.py); then it is JAX's preemption service's, also once the run
    ends: restoring the handler from before would remove JAX's."""
    before = signal.getsignal(signal.SIGTERM)

    def jax_preemption_notifier(_signum, _frame) -> None:
        pass

    try:
        with OutsideLoop(single_process=False) as outside:
            assert signal.getsignal(signal.SIGTERM) is not before
            signal.signal(signal.SIGTERM, jax_preemption_notifier)  # what joining installs
            outside.runtime_joined()
            with StopRequest():
                pass
        assert signal.getsignal(signal.SIGTERM) is jax_preemption_notifier
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_sigterm_that_came_just_before_jax_took_it_over_is_handed_on():
    """A SIGTERM that reached our handler just before JAX's preemption service replaced it, but
    ran it once the processes had joined, goes to JAX's handler, which stops every process after
    the same step: ending this one alone would leave the others waiting in a collective."""
    seen: list[int] = []
    before = signal.getsignal(signal.SIGTERM)
    try:
        with OutsideLoop(single_process=False) as outside:
            ours = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))  # JAX's
            outside.runtime_joined()
            ours(signal.SIGTERM, None)
            for _ in range(1000):  # Python runs the handler on this thread, between bytecodes
                if seen:
                    break
                time.sleep(0.01)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == [signal.SIGTERM]


def test_a_second_sigint_aborts_unless_the_stops_save_has_begun(capfd):
    """Ctrl-C twice aborts; once the stop's save has begun, a second one says (once) that the save
    is finishing, and the run goes on to end as a stop (tests/test_stop_paths.py: the CLI)."""
    with pytest.raises(KeyboardInterrupt), StopRequest() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.signal_name == "SIGINT"
        signal.raise_signal(signal.SIGINT)
    with StopRequest() as stop:
        signal.raise_signal(signal.SIGINT)
        stop.saving_last(5)
        for _ in range(2):
            signal.raise_signal(signal.SIGINT)
    err = capfd.readouterr().err
    assert err.count("SIGINT again: the checkpoint of step 5 is being saved") == 1, err


def _ctrl_c_while_closing_after_a_stop() -> BaseException | None:
    """What a Ctrl-C raises once the loop's stop has saved, as the run writes its summary."""
    try:
        with OutsideLoop(single_process=True):
            with StopRequest() as stop:
                signal.raise_signal(signal.SIGINT)  # the stop
                assert stop.at_step()
                stop.saving_last(3)
            signal.raise_signal(signal.SIGINT)  # again, while the run closes
    except (Stopped, KeyboardInterrupt) as err:
        return err
    return None


def test_a_sigint_once_the_loops_saves_are_written_ends_the_run_saying_they_are_complete(
    sigint_as_in_a_terminal,
):
    """Ctrl-C while the run closes after its loop (the stop's save waited for, the summary being
    written) got Python's KeyboardInterrupt, and the CLI said "interrupted without saving". It
    is a stop while closing, as a SIGTERM there; before the loop, and while a loop that failed
    unwinds, it is still the KeyboardInterrupt that says nothing new was saved."""
    before = signal.getsignal(signal.SIGINT)
    stopped = _ctrl_c_while_closing_after_a_stop()
    assert isinstance(stopped, Stopped), repr(stopped)
    assert stopped.signal_name == "SIGINT" and stopped.loop_started
    line = stopped.line()
    assert line.startswith("stopped by SIGINT while closing the run, after its last step; ")
    assert "its checkpoints are complete" in line
    assert signal.getsignal(signal.SIGINT) is before

    with pytest.raises(KeyboardInterrupt), OutsideLoop(single_process=True):
        signal.raise_signal(signal.SIGINT)  # during start-up
    with pytest.raises(KeyboardInterrupt), OutsideLoop(single_process=True):
        with pytest.raises(RuntimeError), StopRequest():
            raise RuntimeError("a loop that failed")
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_sigint_that_python_ignores_stays_ignored_after_the_loop():
    """A launcher that ignores SIGINT (bash does for a script's background jobs) keeps it so."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with OutsideLoop(single_process=True):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def _c_extension_import() -> None:
    """What a pybind11 module's import does when a signal's exception cuts its initialization."""
    try:
        signal.raise_signal(signal.SIGTERM)
    except BaseException as err:
        raise ImportError("initialization failed") from err


def test_a_stop_that_cut_a_c_extensions_import_is_that_stop():
    """A SIGTERM while tensorstore's extension module was being imported ended in an ImportError
    traceback and exit 1, where any other start-up stop is one line and the stop's status."""
    with pytest.raises(Stopped) as stopped, OutsideLoop(single_process=True):
        _c_extension_import()
    assert stopped.value.line().startswith("stopped by SIGTERM during start-up")


def test_an_error_raised_while_handling_a_stop_stays_that_error():
    with pytest.raises(OSError), OutsideLoop(single_process=True):
        try:
            signal.raise_signal(signal.SIGTERM)
        except Stopped:
            raise OSError("a cleanup failed")  # noqa: B904 (the stop is its context, not cause)
