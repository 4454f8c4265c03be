"""The step watchdog: a loop that stops making progress writes its stacks and one line saying
what it waited for, then exits non-zero; a loop that is merely slow (compiling, evaluating,
saving) does not trip it. The 2-process case (a SIGSTOPped peer) is in test_multihost.py."""

import io
import subprocess
import sys
import time

import pytest
from conftest import TINY

from trainer.observe import watchdog as wd
from trainer.observe.watchdog import Watchdog


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_automatic_limit_is_generous_and_learnt_from_the_first_steps():
    clock = FakeClock()
    dog = Watchdog(None, clock=clock)
    assert dog.limit_s() == wd.STARTUP_S, "the first steps compile"
    for step in range(1, wd.CALIBRATION_STEPS + 2):
        clock.now += 100.0 if step == 1 else 2.0  # step 1 compiles: not counted
        dog.beat(step)
    assert dog.limit_s() == wd.FLOOR_S, "10 x 2 s is below the floor"
    dog.durations = [60.0] * wd.CALIBRATION_STEPS
    assert dog.limit_s() == 600.0
    with dog.phase("eval"):
        assert dog.limit_s() == wd.STARTUP_S, "an eval may take long"


def test_an_explicit_limit_applies_once_the_first_step_finished():
    clock = FakeClock()
    dog = Watchdog(5.0, clock=clock)
    with dog.phase("data", step=1):
        clock.now += 60.0
        assert not dog.overdue(), "step 1 compiles"
    dog.beat(1)
    with dog.phase("data", step=2):
        clock.now += 4.0
        assert not dog.overdue()
        clock.now += 2.0
        assert dog.overdue()


def test_a_trip_writes_stacks_and_one_line_then_exits():
    clock, out, codes = FakeClock(), io.StringIO(), []
    dog = Watchdog(5.0, clock=clock, out=out, on_timeout=codes.append)
    dog.beat(7)
    with dog.phase("data", step=8):
        clock.now += 6.0
        dog.trip()
    text = out.getvalue()
    assert codes == [wd.EXIT_STUCK]
    assert "test_a_trip_writes_stacks_and_one_line_then_exits" in text, "this thread's stack"
    [line] = [x for x in text.splitlines() if x.startswith("error: watchdog")]
    assert "at step 8, last completed step 7, waiting for data (the input pipeline)" in line


def test_a_sub_second_limit_is_not_printed_as_zero_seconds():
    clock, out = FakeClock(), io.StringIO()
    dog = Watchdog(0.02, clock=clock, out=out, on_timeout=lambda code: None)
    dog.beat(1)
    with dog.phase("step", step=2):
        clock.now += 0.05
        dog.trip()
    assert "no progress for 0.05 s (limit 0.02 s, run.step_timeout_s)" in out.getvalue()


def test_the_thread_trips_on_a_real_clock():
    codes = []
    dog = Watchdog(0.2, out=io.StringIO(), on_timeout=codes.append, poll_s=0.05)
    with dog:
        dog.beat(1)
        deadline = time.monotonic() + 5
        while not codes and time.monotonic() < deadline:
            time.sleep(0.05)
    assert codes == [wd.EXIT_STUCK]


# A run whose data source delivers 4 batches, then blocks forever (a reader on a dead mount).
BLOCKING_RUN = """
import sys, threading
import numpy as np
from absl import flags
flags.FLAGS.mark_as_parsed()
import trainer

def batches():
    rng = np.random.default_rng(0)
    for _ in range(4):
        tokens = rng.integers(0, 256, (16, 65), dtype=np.int32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
               "weights": np.ones((16, 64), np.float32)}
    threading.Event().wait()  # never returns

trainer.run(trainer.load_config(None, sys.argv[1:]), data=batches())
"""


@pytest.mark.slow
def test_a_data_source_that_blocks_trips_the_watchdog_and_names_the_data_wait(tmp_path, repo_root):
    args = [o for o in TINY if not o.startswith("eval.")]
    args += ["model.vocab_size=256", "run.steps=20", "run.step_timeout_s=8", "eval.every=1000"]
    args += ["checkpoint.every=1000", "log.tensorboard=false", f"run.workdir={tmp_path / 'run'}"]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", BLOCKING_RUN, *args],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.monotonic() - start
    assert done.returncode == wd.EXIT_STUCK, done.stderr[-3000:]
    [line] = [x for x in done.stderr.splitlines() if x.startswith("error: watchdog")]
    assert "at step 5, last completed step 4, waiting for data (the input pipeline)" in line
    assert "in batches" in done.stderr, "the blocked reader's stack"
    assert 'File "<string>"' in done.stderr
    print(f"\nwatchdog exit after {took:.1f} s")
