"""The loop around the step: it reads a step's metrics once the device has finished it, keeping
up to `IN_FLIGHT` steps queued instead of waiting on each one; and the checkpoint warm-up sets
up the first save before the first step, leaving nothing behind."""

import io
import json
import shutil
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import tiny_run

from input_pipeline.device import DeviceFeed
from trainer.config import MeshConfig, load_config
from trainer.data import DataSources
from trainer.loop import IN_FLIGHT, Loop
from trainer.observe.metrics import MetricsWriter
from trainer.parallel import sharding
from trainer.train import run

STEPS = 12


@dataclass
class FakeDevice:
    """Finishes step t once step t + `lag` has been dispatched: a device `lag` steps behind."""

    lag: int
    dispatched: int = 0
    waits: list[int] = field(default_factory=list)  # steps the host had to wait for
    ahead: list[int] = field(default_factory=list)  # per read: later steps already dispatched


@dataclass
class FakeMetrics:
    device: FakeDevice
    step: int
    copies: int = 0

    def start_copy(self) -> None:
        self.copies += 1

    def is_ready(self) -> bool:
        return self.device.dispatched >= self.step + self.device.lag

    def read(self) -> dict[str, float]:
        if not self.is_ready():
            self.device.waits.append(self.step)  # a real read would block here
        self.device.ahead.append(self.device.dispatched - self.step)
        one = 1.0
        return {"loss": one, "grad_norm": one, "lr": one, "tokens": 8.0, "params_finite": one}


@dataclass
class FakeProgram:
    device: FakeDevice
    batch_sharding: object

    def stepper(self):
        def step(state, batch):
            self.device.dispatched += 1
            return state + 1, FakeMetrics(self.device, state + 1)

        return step


class NoCheckpoints:
    def warm_up(self, state, meta) -> None:
        pass

    def save(self, step, state, data_state, meta) -> float:
        return 0.0

    def wait(self) -> None:
        pass


def run_loop(lag: int, tmp_path, monkeypatch) -> FakeDevice:
    # batches are always there: the loop reads early only for a data wait (test_watchdog.py)
    monkeypatch.setattr(DeviceFeed, "ready", lambda self: True)
    config = load_config(
        None,
        [
            f"run.workdir={tmp_path}",
            f"run.steps={STEPS}",
            "log.every=1",
            f"checkpoint.every={STEPS}",
            f"eval.every={STEPS}",
        ],
    )
    device = FakeDevice(lag)
    batches = iter([{"inputs": np.zeros((8, 4), np.int32)}] * STEPS)
    program = FakeProgram(device, sharding.batch_sharding(sharding.make_mesh(MeshConfig())))
    sources = DataSources(train=batches, make_eval=None, description="fake", fingerprint="")
    writer = MetricsWriter(tmp_path, total_steps=STEPS, tensorboard=False, stream=io.StringIO())
    loop = Loop(config, sources, program, NoCheckpoints(), writer, meta={})
    loop.train(0, 0)
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, STEPS + 1))
    return device


@pytest.mark.parametrize("lag", [1, IN_FLIGHT])
def test_the_host_never_waits_for_a_step_the_device_may_still_be_running(
    lag, tmp_path, monkeypatch
):
    """With the device up to `IN_FLIGHT` steps behind, the host reads each step's metrics
    without waiting for it; only the final save waits, for the steps still running, as it must.
    (Reading step t-1 right after dispatching t, as the loop once did, waits at every step
    once the device is two steps behind.)"""
    device = run_loop(lag, tmp_path, monkeypatch)
    assert device.waits == list(range(STEPS - lag + 1, STEPS + 1))


def test_a_device_further_behind_holds_the_host_back_at_in_flight_steps(tmp_path, monkeypatch):
    """A slower device makes the host wait, for the oldest step: never more than `IN_FLIGHT`
    steps are dispatched and unread, so the host cannot run away from the device."""
    device = run_loop(IN_FLIGHT + 2, tmp_path, monkeypatch)
    assert len(device.waits) > IN_FLIGHT + 2  # it had to wait before the end too
    assert max(device.ahead) == IN_FLIGHT


def test_checkpoint_warm_up_runs_once_and_leaves_nothing_behind(corpus, tmp_path, monkeypatch):
    """A run that saves before its last step warms the first save up once, before its first
    step; the throwaway save is gone at the end (also one a killed run left behind), and the
    run's own checkpoints resume as before."""
    from trainer.checkpoint import Checkpointer

    warmed = []
    real_warm_up = Checkpointer.warm_up

    def counting_warm_up(self, state, meta):
        warmed.append(self.directory)
        real_warm_up(self, state, meta)

    monkeypatch.setattr(Checkpointer, "warm_up", counting_warm_up)
    run(tiny_run(corpus, tmp_path, 4))
    checkpoints = tmp_path / "checkpoints"
    warm_folder = tmp_path / "checkpoints.warm_up"
    assert warmed == [checkpoints] and not warm_folder.exists()
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2", "4"]
    shutil.copytree(checkpoints / "4", warm_folder / "0")  # as a killed warm-up leaves it
    result = run(tiny_run(corpus, tmp_path, 8))  # resumes from 4, warms up again
    assert result.step == 8 and len(warmed) == 2 and not warm_folder.exists()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "loss" in r) == list(range(1, 9))


@dataclass
class TimedDevice:
    """A device that runs each step in `STEP_S` of a fake clock, one after the other, starting
    each when it is dispatched or the one before ends; the host's own work takes no time."""

    now: float = 0.0
    ends: list[float] = field(default_factory=list)  # each dispatched step's end

    def dispatch(self) -> int:
        self.ends.append(max(self.now, self.ends[-1] if self.ends else 0.0) + STEP_S)
        return len(self.ends)


STEP_S, SAVE_S = 1.0, 100.0


@dataclass
class TimedMetrics:
    device: TimedDevice
    step: int

    def start_copy(self) -> None:
        pass

    def is_ready(self) -> bool:
        return self.device.now >= self.device.ends[self.step - 1]

    def read(self) -> dict[str, float]:
        self.device.now = max(self.device.now, self.device.ends[self.step - 1])  # blocks
        one = 1.0
        return {"loss": one, "grad_norm": one, "lr": one, "tokens": 8.0, "params_finite": one}


def test_a_steps_time_is_its_own_not_its_dispatch_nor_a_save_before_it(tmp_path, monkeypatch):
    """Every step takes STEP_S on the device, so every line says STEP_S. Timed from dispatch to
    dispatch, as before, the first steps, dispatched into an idle queue, took no time, a later
    one took theirs, and the step after a save took the save's SAVE_S too."""
    import trainer.loop

    device = TimedDevice()
    monkeypatch.setattr(trainer.loop, "time", SimpleNamespace(perf_counter=lambda: device.now))
    monkeypatch.setattr(DeviceFeed, "ready", lambda self: True)

    class Program:
        batch_sharding = sharding.batch_sharding(sharding.make_mesh(MeshConfig()))

        def stepper(self):
            return lambda state, batch: (state + 1, TimedMetrics(device, device.dispatch()))

    class SlowSaves(NoCheckpoints):
        def save(self, step, state, data_state, meta) -> float:
            device.now += SAVE_S
            return 0.0

    config = load_config(
        None,
        [f"run.workdir={tmp_path}", f"run.steps={STEPS}", "log.every=1", "checkpoint.every=4"],
    )
    batches = iter([{"inputs": np.zeros((8, 4), np.int32)}] * STEPS)
    sources = DataSources(train=batches, make_eval=None, description="fake", fingerprint="")
    writer = MetricsWriter(tmp_path, total_steps=STEPS, tensorboard=False, stream=io.StringIO())
    Loop(config, sources, Program(), SlowSaves(), writer, meta={}).train(0, 0)
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["step_time_s"] for r in rows if "loss" in r}
    assert times == {step: STEP_S for step in range(1, STEPS + 1)}


@pytest.mark.slow
def test_a_stop_between_evals_names_the_step_of_the_eval_loss_it_reports(
    corpus, tmp_path, monkeypatch
):
    """A run stopped a step or more after an eval at step 5 ended with `eval_loss=...` alone,
    read as the stopped step's loss; the last line now names the step the eval was measured at.
    The stop lands up to two steps after the signal (steps in flight), never at an eval."""
    import os
    import signal

    from trainer.main import finished

    write = MetricsWriter.write

    def stop_after_step_6(self, step, row, *args, **kwargs):
        write(self, step, row, *args, **kwargs)
        if step == 6 and "loss" in row:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(MetricsWriter, "write", stop_after_step_6)
    config = tiny_run(corpus, tmp_path / "run", steps=40).derive(
        {"eval.every": 5, "log.every": 1, "checkpoint.every": 100}
    )
    result = run(config)
    assert result.eval_step == 5 < result.step < 10
    line, _ = finished(result, 40)
    assert line.endswith(f"; eval_loss={result.eval_loss:.4f} (at step 5)"), line
