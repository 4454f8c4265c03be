"""How a run stops. A stop while a data source is stuck in a read (a dead mount) saves and ends
the run without waiting for that read: under Slurm the grace period after SIGTERM is about 30 s,
and closing the feed used to wait 10 s for a reader that never returns whenever the loop saw the
stop somewhere else than in its own wait for that batch (after a step, or between two eval
batches). A second Ctrl-C once the stop's checkpoint is being saved lets that save finish and
says so, instead of cutting it (or waiting for it anyway) and saying nothing was saved; one once
it is written (as the run closes, or as the process exits) says the checkpoint is complete, or
ends the exit at once, instead of "interrupted without saving" or a traceback."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import SHARED_SCHEDULE, TINY

from trainer.config import load_config
from trainer.main import main
from trainer.observe.metrics import read_metrics
from trainer.train import run

ROWS, LENGTH = 16, 64
WAIT_S = 240  # a generous bound on a run that ends by itself, never asserted on


def random_batch(seed: int) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 256, (ROWS, LENGTH + 1), dtype=np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": np.ones((ROWS, LENGTH), np.float32),
    }


def healthy_batches():
    seed = 0
    while True:
        yield random_batch(seed)
        seed += 1


class StuckRead:
    """Batch `stuck_at` of a source: reading it sends the run a SIGTERM (the job's time runs out)
    and never returns, until the test ends (`release`) or a join waits for it (`waited`)."""

    def __init__(self, stuck_at: int, signal_run: bool = True) -> None:
        self.stuck_at, self.signal_run = stuck_at, signal_run
        self.thread: threading.Thread | None = None  # the feed thread stuck in the read
        self.waited: list[float | None] = []  # the timeouts of joins that waited for it
        self._released = threading.Event()

    def batches(self):
        seed = 0
        while True:
            if seed == self.stuck_at:
                self.thread = threading.current_thread()
                if self.signal_run:
                    os.kill(os.getpid(), signal.SIGTERM)
                self._released.wait()
                return
            yield random_batch(seed)
            seed += 1

    def release(self) -> None:
        self._released.set()


@pytest.fixture
def stuck(monkeypatch):
    """A `StuckRead` factory; a join that would wait for the stuck thread is recorded and lets
    the read return at once, so that the test shows the wait without taking its time."""
    reads: list[StuckRead] = []
    real_join = threading.Thread.join

    def recording_join(thread: threading.Thread, timeout: float | None = None) -> None:
        for read in reads:
            if thread is read.thread and timeout != 0:
                read.waited.append(timeout)
                read.release()
        real_join(thread, timeout)

    monkeypatch.setattr(threading.Thread, "join", recording_join)
    outside = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stray one must not end pytest
    try:
        yield lambda *args: reads.append(StuckRead(*args)) or reads[-1]
    finally:
        signal.signal(signal.SIGTERM, outside)
        for read in reads:
            read.release()


def config(workdir, *extra: str):
    args = [*TINY, "model.vocab_size=256", "run.steps=8", "optim.decay_steps=8"]
    args += ["checkpoint.every=100", "log.tensorboard=false", "data.prefetch=4"]
    return load_config(None, [*args, f"run.workdir={workdir}", *extra])


def saved_steps(workdir) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_a_stop_after_a_step_does_not_wait_for_a_stuck_training_read(stuck, tmp_path, capfd):
    """Batches 0-3 fill the feed's 4 slots; reading batch 4 sends the SIGTERM and sticks. The
    loop sees the stop after a step, saves it and closes the feed, whose thread is in that read."""
    read = stuck(4)
    result = run(config(tmp_path, "eval.every=100"), data=read.batches())
    assert read.thread is not None and result.step < 5
    assert saved_steps(tmp_path) == [result.step]
    assert f"stopped by SIGTERM at step {result.step}" in capfd.readouterr().err
    assert read.waited == [], "closing the feed waited for a read that never returns"


def test_a_stop_between_eval_batches_does_not_wait_for_a_stuck_eval_read(stuck, tmp_path, capfd):
    """The eval after step 2 gets its batch 0; reading batch 1 sends the SIGTERM and sticks. The
    eval ends at its next batch, and the run saves step 2."""
    read = stuck(1)
    args = ["eval.every=2", "eval.steps=4"]
    result = run(config(tmp_path, *args), data=healthy_batches(), eval_data=read.batches)
    assert read.thread is not None and result.step == 2
    assert saved_steps(tmp_path) == [2]
    assert "stopped by SIGTERM at step 2" in capfd.readouterr().err
    assert read.waited == [], "closing the eval's feed waited for a read that never returns"


def test_an_abort_does_not_wait_for_a_stuck_read(stuck, tmp_path, monkeypatch):
    """A second Ctrl-C before the stop's save aborts (KeyboardInterrupt) wherever the loop is,
    here in the save of step 2, while the feed's thread is stuck reading batch 4: the abort ends
    the run without waiting for that read."""
    from trainer.checkpoint import Checkpointer

    read = stuck(4, False)
    real_save = Checkpointer.save

    def abort_once_the_read_is_stuck(self, step, *args):
        if step == 0:  # the warm-up's throwaway save, before the first step
            return real_save(self, step, *args)
        while read.thread is None:  # batches 2 and 3 fill the slots steps 1 and 2 freed
            time.sleep(0.01)
        raise KeyboardInterrupt

    monkeypatch.setattr(Checkpointer, "save", abort_once_the_read_is_stuck)
    with pytest.raises(KeyboardInterrupt):
        run(config(tmp_path, "eval.every=100", "checkpoint.every=2"), data=read.batches())
    assert read.waited == [], "closing the feed waited for a read that never returns"


def test_ctrl_c_after_the_stops_save_says_the_checkpoint_is_complete(
    corpus, tmp_path, repo_root, monkeypatch, capfd, sigint_as_in_a_terminal
):
    """Ctrl-C stops the run after step 1 (its save written), and again as the run writes its
    summary. Before: Python's KeyboardInterrupt there, and the CLI said "interrupted without
    saving" (rc 130) of a run whose checkpoint was complete."""
    import trainer.loop
    from trainer.preemption import StopRequest

    real_at_step, real_summary = StopRequest.at_step, trainer.loop.format_summary

    def ctrl_c_first(stop: StopRequest) -> bool:
        if stop.signal_name is None:
            signal.raise_signal(signal.SIGINT)
        return real_at_step(stop)

    def ctrl_c_again(summary) -> str:
        signal.raise_signal(signal.SIGINT)
        return real_summary(summary)

    monkeypatch.setattr(StopRequest, "at_step", ctrl_c_first)
    monkeypatch.setattr(trainer.loop, "format_summary", ctrl_c_again)
    workdir = tmp_path / "run"
    args = ["--config", str(repo_root / "configs/tiny.yaml"), *TINY, f"data.path={corpus}"]
    args += ["run.steps=4", SHARED_SCHEDULE, "log.tensorboard=false", f"run.workdir={workdir}"]
    assert main(args) == 0
    err = capfd.readouterr().err
    assert saved_steps(workdir) == [1]
    assert "stopped by SIGINT at step 1; checkpoint saved" in err
    assert err.endswith(
        "stopped by SIGINT while closing the run, after its last step; its checkpoints are "
        "complete: re-run the same command to resume\n"
    ), err[-2000:]
    assert "interrupted without saving" not in err and "Traceback" not in err


# `python -m trainer.main` with a run that trains nothing, and a Ctrl-C from an exit-time callback,
# as one pressed while the process goes through Python's and JAX's cleanups after its last line.
EXITING_RUN = """
import atexit, os, runpy, signal, sys, types
import trainer.train

trainer.train.run = lambda config: types.SimpleNamespace(step=config.run.steps, eval_loss=None)
atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))
sys.argv = ["trainer.main", "--config", "configs/tiny.yaml"]
runpy.run_module("trainer.main", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_the_process_exits_ends_it_without_a_traceback(repo_root):
    """Before: "Exception ignored in atexit callback" and a KeyboardInterrupt traceback after the
    run's last line."""
    done = subprocess.run(
        [sys.executable, "-c", EXITING_RUN],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "finished at step 20\n", done.stderr[-3000:]


# The CLI, with SECOND_SIGINT set to `save` or `wait`: the process sends itself a SIGINT as the loop
# enters that call of its Checkpointer once the first SIGINT was seen, as Ctrl-C pressed again
# while the stop's checkpoint is being started, or written.
TWICE_RUN = """
import os, signal, sys
from trainer.checkpoint import Checkpointer
from trainer.main import main

def first_sigint_seen():
    stop = getattr(signal.getsignal(signal.SIGINT), "__self__", None)  # the loop's StopRequest
    return getattr(stop, "signal_name", None) == "SIGINT"

if os.environ.get("SECOND_SIGINT"):
    name, sent = os.environ["SECOND_SIGINT"], []
    real = getattr(Checkpointer, name)
    def sigint_again_then(self, *args):
        if first_sigint_seen() and not sent:
            sent.append(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args)
    setattr(Checkpointer, name, sigint_again_then)

sys.exit(main(sys.argv[1:]))
"""


def twice_run(repo_root, corpus, workdir, steps: int, **env: str) -> subprocess.Popen:
    args = ["--config", "configs/tiny.yaml", *TINY, f"data.path={corpus}", f"run.steps={steps}"]
    args += [SHARED_SCHEDULE, "checkpoint.every=1000", "eval.every=1000", "log.tensorboard=false"]
    return subprocess.Popen(
        [sys.executable, "-c", TWICE_RUN, *args, f"run.workdir={workdir}"],
        cwd=repo_root,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def logged_steps(workdir) -> list[int]:
    """The steps with a loss line, read while the run may be writing the next one: a row that
    straddles a page is written one page at a time, and its first part read alone is no row
    (`json.loads` of it failed the test)."""
    metrics = workdir / "metrics.jsonl"
    rows = read_metrics(metrics).rows if metrics.exists() else []
    return [row["step"] for row in rows if "loss" in row]


def exit_of(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"no exit within {WAIT_S} s:\n{stderr[-3000:]}")
    return proc.returncode, stderr


@pytest.mark.slow
@pytest.mark.parametrize("during", ["save", "wait"])
def test_ctrl_c_again_while_the_stop_saves_lets_the_save_finish(
    during, corpus, tmp_path, repo_root
):
    """Ctrl-C, then Ctrl-C again as the stop's checkpoint is started (`save`) or written
    (`wait`). Before: a KeyboardInterrupt in the middle of Orbax's save: rc 130 and "interrupted
    without saving", with the save either cut (a partial folder, Orbax's tracebacks at exit) or,
    once written, waited for anyway by the run's close (saved after all, said not to be)."""
    workdir = tmp_path / "run"
    proc = twice_run(repo_root, corpus, workdir, 1000, SECOND_SIGINT=during)
    try:
        deadline = time.monotonic() + WAIT_S
        while len(logged_steps(workdir)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "never trained 2 steps"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        code, stderr = exit_of(proc)
    finally:
        proc.kill()
    assert code == 0, stderr[-3000:]
    [step] = saved_steps(workdir)
    assert f"SIGINT again: the checkpoint of step {step} is being saved" in stderr, stderr[-3000:]
    assert f"stopped by SIGINT at step {step}; checkpoint saved" in stderr
    assert f"finished at step {step} of 1000: stopped early" in stderr
    assert "Traceback" not in stderr and "ERROR" not in stderr

    code, stderr = exit_of(twice_run(repo_root, corpus, workdir, step + 2))
    assert code == 0 and f"(step {step})" in stderr, stderr[-3000:]
    assert logged_steps(workdir)[-2:] == [step + 1, step + 2]
