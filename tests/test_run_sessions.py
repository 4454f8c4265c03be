"""A session at the edges of a run: a dataset prepared without an eval split trains without evals
(one line says so at the start) and still saves its final checkpoint; running a finished run again
changes nothing, its summary.json included; a SIGTERM while the data source blocks stops the run
with its last step saved, and the resume continues it exactly; a SIGTERM during the final save
lets it finish."""

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SHARED_SCHEDULE, TINY

from trainer.config import load_config
from trainer.observe.metrics import read_metrics
from trainer.train import run


def rows_of(workdir: Path) -> list[dict]:
    return read_metrics(workdir / "metrics.jsonl").rows


def saved_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def train_only_corpus(tmp_path_factory) -> Path:
    """Real text prepared as `prepare --eval-fraction 0` does: a train split and no other."""
    from input_pipeline.prepare import prepare_dataset

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in sorted(stdlib.glob("*.py"))]
    out = tmp_path_factory.mktemp("data") / "train-only"
    prepare_dataset(texts[:40], out, eval_fraction=0.0, progress=False)
    assert list(json.loads((out / "dataset.json").read_text())["splits"]) == ["train"]
    return out


@pytest.mark.slow
def test_a_dataset_without_an_eval_split_trains_without_evals(train_only_corpus, tmp_path, capfd):
    workdir = tmp_path / "run"
    args = [f"data.path={train_only_corpus}", f"run.workdir={workdir}", "log.tensorboard=false"]
    args += ["run.steps=4", SHARED_SCHEDULE, "checkpoint.every=2", "eval.every=2"]
    result = run(load_config(None, [*TINY, *args]))
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "without evals" in line] == [
        f"data {train_only_corpus} has no eval split; training without evals (prepare it with "
        "--eval-fraction or --eval-input to get eval_loss)"
    ], err[-2000:]
    assert result.step == 4 and result.eval_loss is None
    assert saved_steps(workdir) == [2, 4], "the final checkpoint is saved"
    rows = rows_of(workdir)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert not [r for r in rows if "eval_loss" in r]


@pytest.mark.slow
def test_running_a_finished_run_again_keeps_its_summary(corpus, tmp_path, capfd):
    """A session that trains no step leaves the last session's summary.json as it was: a re-run
    of a finished job is a no-op, as in torchtitan and MaxText."""
    workdir = tmp_path / "run"
    args = [*TINY, f"data.path={corpus}", f"run.workdir={workdir}", "log.tensorboard=false"]
    args += ["run.steps=3", SHARED_SCHEDULE, "checkpoint.every=3", "eval.every=3"]
    run(load_config(None, args))
    summary = (workdir / "summary.json").read_text()
    assert json.loads(summary)["steps"] == 3 and json.loads(summary)["eval_loss"] is not None
    capfd.readouterr()
    result = run(load_config(None, args))
    err = capfd.readouterr().err
    assert result.step == 3
    assert (workdir / "summary.json").read_text() == summary
    assert "run already at step 3 >= run.steps=3" in err
    assert "where the time went" not in err, "no table for a session that did nothing"


@pytest.mark.slow
def test_resuming_on_other_data_says_so(corpus, train_only_corpus, tmp_path, capfd):
    """Every checkpoint records its dataset's fingerprint; a resume on another dataset used to
    carry the saved read position over without a word."""
    workdir = tmp_path / "run"
    args = [*TINY, f"run.workdir={workdir}", "log.tensorboard=false", "checkpoint.every=2"]
    args += [SHARED_SCHEDULE]  # the three sessions share one compiled step
    run(load_config(None, [*args, f"data.path={corpus}", "run.steps=2"]))
    run(load_config(None, [*args, f"data.path={corpus}", "run.steps=3"]))
    assert "trained on other data" not in capfd.readouterr().err
    run(load_config(None, [*args, f"data.path={train_only_corpus}", "run.steps=4"]))
    warnings = [line for line in capfd.readouterr().err.splitlines() if "other data" in line]
    assert len(warnings) == 1 and f"checkpoint.init_from={workdir}" in warnings[0], warnings


# A caller's LM batches with a position (`get_state`/`set_state`, as a Grain iterator has): batch i
# is drawn from seed i. With BLOCK_AT set, reading that batch waits forever (a dead mount); with
# EVAL_BLOCK_AT, reading that batch of each eval does, once it has created the file BLOCKED.
CALLER_RUN = """
import os, sys, threading
import numpy as np
from absl import flags
flags.FLAGS.mark_as_parsed()
import trainer

def batch(seed, block_at):
    if seed == int(os.environ.get(block_at, "-1")):
        open(os.environ.get("BLOCKED", os.devnull), "w").close()
        threading.Event().wait()
    tokens = np.random.default_rng(seed).integers(0, 256, (16, 65), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones((16, 64), np.float32)}

class Batches:
    def __init__(self):
        self.position = 0
    def __iter__(self):
        return self
    def __next__(self):
        self.position += 1
        return batch(self.position - 1, "BLOCK_AT")
    def get_state(self):
        return {"position": self.position}
    def set_state(self, state):
        self.position = state["position"]

if os.environ.get("TERM_AFTER_SAVING"):  # the job's time runs out while that save writes
    import signal
    from trainer.checkpoint import Checkpointer
    save, wait, saved, signalled = Checkpointer.save, Checkpointer.wait, [], []
    def noting_save(self, step, *args):
        saved.append(step)
        return save(self, step, *args)
    def sigterm_then_wait(self):  # the first wait once that save is under way: the run's last
        if saved[-1:] == [int(os.environ["TERM_AFTER_SAVING"])] and not signalled:
            signalled.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        wait(self)
    Checkpointer.save, Checkpointer.wait = noting_save, sigterm_then_wait

def held_out_batch(seed):
    if seed == int(os.environ.get("EVAL_TERM_AT", "-1")):  # the job's time runs out in an eval
        import signal
        os.kill(os.getpid(), signal.SIGTERM)
    return batch(seed, "EVAL_BLOCK_AT")

eval_batches = int(os.environ.get("EVAL_BATCHES", "2"))
held_out = lambda: (held_out_batch(seed) for seed in range(eval_batches))
trainer.run(trainer.load_config(None, sys.argv[1:]), data=Batches(), eval_data=held_out)
"""


def caller_args(workdir: Path, *extra: str) -> list[str]:
    args = [*TINY, "model.vocab_size=256", "run.steps=8", "optim.decay_steps=8"]
    args += ["checkpoint.every=4", "eval.every=100", "log.tensorboard=false"]
    return [*args, f"run.workdir={workdir}", *extra]


def caller_run(repo_root: Path, workdir: Path, *extra: str, **env: str) -> subprocess.Popen:
    args = caller_args(workdir, *extra)
    return subprocess.Popen(
        [sys.executable, "-c", CALLER_RUN, *args],
        cwd=repo_root,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1", **env},  # stacks on SIGABRT: `finished`
    )


def caller_run_in_this_process(workdir: Path, monkeypatch) -> None:
    """`CALLER_RUN` as `caller_run` starts it with no blocking or signal set, but in the test's
    own process (an error raises): for the runs whose process is not what a test is about (a
    reference, a resume), which a new process makes seconds longer."""
    monkeypatch.setattr(sys, "argv", ["-c", *caller_args(workdir)])
    for name in ("BLOCK_AT", "EVAL_BLOCK_AT", "BLOCKED", "TERM_AFTER_SAVING", "EVAL_TERM_AT"):
        monkeypatch.delenv(name, raising=False)
    exec(compile(CALLER_RUN, "<CALLER_RUN>", "exec"), {"__name__": "__main__"})


def losses_of(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows_of(workdir) if "loss" in r}


def finished(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    """The run's stderr once it exited 0; past `timeout_s`, a failure with what it said and
    every thread's stack (SIGABRT: Python's fault handler, which `caller_run` turns on)."""
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, stderr = proc.communicate(timeout=60)
        pytest.fail(f"no exit within {timeout_s} s; its stderr, then its stacks:\n{stderr[-8000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    return stderr


def sigterm_once(proc: subprocess.Popen, ready: Callable[[], bool], what: str) -> str:
    """SIGTERM `proc` once `ready()` holds; its stderr after a clean exit. Before the fix, a run
    waiting on a blocked source never exited."""
    try:
        deadline = time.monotonic() + 240
        while not ready():
            assert time.monotonic() < deadline and proc.poll() is None, f"never reached {what}"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        return finished(proc, timeout_s=120)  # a save and an exit
    finally:
        proc.kill()


@pytest.mark.slow
def test_sigterm_while_the_data_source_blocks_saves_the_last_step_and_resumes_exactly(
    tmp_path, repo_root, monkeypatch
):
    """Before: the loop waited for the blocked source's batch with no timeout and never looked
    at the stop the signal asked for; only SIGKILL or the watchdog ended the run, unsaved."""
    straight = tmp_path / "straight"
    caller_run_in_this_process(straight, monkeypatch)  # the reference, never stopped
    expected = losses_of(straight)

    workdir = tmp_path / "stopped"
    proc = caller_run(repo_root, workdir, BLOCK_AT="5")  # steps 1-5 get batches; 6 waits
    logged = workdir / "metrics.jsonl"
    stderr = sigterm_once(proc, lambda: logged.exists() and 5 in losses_of(workdir), "step 5")
    assert f"stopped by SIGTERM at step 5; checkpoint saved in {workdir / 'checkpoints/5'}" in (
        stderr
    ), stderr[-3000:]
    assert saved_steps(workdir) == [4, 5]

    caller_run_in_this_process(workdir, monkeypatch)  # resumes at step 5, batch 5 next
    got = losses_of(workdir)
    assert [got[s] for s in range(1, 9)] == [expected[s] for s in range(1, 9)]


@pytest.mark.slow
def test_sigterm_while_an_eval_source_blocks_saves_the_step_and_stops(tmp_path, repo_root):
    """The eval after step 3 waits for a held-out batch that never comes. Before: the signal
    was never looked at, as for training data."""
    workdir, blocked = tmp_path / "run", tmp_path / "blocked"
    proc = caller_run(
        repo_root, workdir, "eval.every=3", "log.every=2", EVAL_BLOCK_AT="1", BLOCKED=str(blocked)
    )
    stderr = sigterm_once(proc, blocked.exists, "the eval's block")  # its second batch waits
    assert f"stopped by SIGTERM at step 3; checkpoint saved in {workdir / 'checkpoints/3'}" in (
        stderr
    ), stderr[-3000:]
    assert saved_steps(workdir) == [3]
    assert sorted(losses_of(workdir)) == [2, 3], "the stop's line reports step 3 (log.every=2)"
    assert not [r for r in rows_of(workdir) if "eval_loss" in r]


@pytest.mark.slow
def test_sigterm_during_a_long_eval_ends_it_and_saves_the_step(tmp_path, repo_root):
    """Eval batches that are all ready: before, the signal was looked at only while waiting for
    one, so the 400-batch eval ran to its end and then step 4 trained before the stop; under
    Slurm's grace period a long eval was killed unsaved."""
    workdir = tmp_path / "run"
    args = ["eval.every=3", "eval.steps=400", "log.every=1"]
    proc = caller_run(repo_root, workdir, *args, EVAL_BATCHES="400", EVAL_TERM_AT="2")
    stderr = finished(proc)
    assert f"stopped by SIGTERM at step 3; checkpoint saved in {workdir / 'checkpoints/3'}" in (
        stderr
    ), stderr[-3000:]
    assert saved_steps(workdir) == [3]
    assert not [r for r in rows_of(workdir) if "eval_loss" in r]


@pytest.mark.slow
def test_a_sigterm_during_the_final_save_lets_it_finish(tmp_path, repo_root):
    """The end of a run waits for its last save to be written. The signal handlers used to be
    gone by then, so a SIGTERM (a job's time limit) killed the process mid-write and the resume
    went back to the previous checkpoint."""
    workdir = tmp_path / "run"
    finished(caller_run(repo_root, workdir, TERM_AFTER_SAVING="8"))  # before: killed, rc -15
    assert saved_steps(workdir) == [4, 8]
    assert sorted(losses_of(workdir)) == list(range(1, 9))
