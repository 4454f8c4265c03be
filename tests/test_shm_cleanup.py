"""Grain worker processes (`data.workers > 0`) leave nothing behind: no process, no shared memory
segment in /dev/shm, and no "leaked shared_memory" warning in the run's log, whether the run
finishes (on one process or several), the scheduler signals the whole job (Slurm's preemption:
SIGTERM to every process) or the trainer dies without stopping its workers (an out-of-memory
kill, the watchdog's exit)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TINY, compile_cache
from jax.sharding import NamedSharding, PartitionSpec
from test_multihost import cpu_env, end_launcher, reserved_port, run_args

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc"),
]
SEGMENT = re.compile(r"/dev/shm/(psm_\w+)")
WAIT_S = 120  # generous bounds on waits that end on an event, never asserted on


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def segments_of(pids: list[int]) -> set[str]:
    """The shared memory segments these processes have mapped or open."""
    names: set[str] = set()
    for pid in pids:
        try:
            names.update(SEGMENT.findall(Path(f"/proc/{pid}/maps").read_text()))
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                names.update(SEGMENT.findall(os.readlink(fd)))
        except OSError:
            continue
    return names


def losses_logged(workdir: Path) -> int:
    metrics = workdir / "metrics.jsonl"
    return metrics.read_text().count('"loss"') if metrics.exists() else 0


def start_run(corpus: Path, workdir: Path, repo_root: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml", *TINY]
    cmd += [f"data.path={corpus}", "data.workers=2", "run.steps=100000", "checkpoint.every=1000"]
    cmd += ["eval.every=1000", "log.tensorboard=false", f"run.workdir={workdir}"]
    return subprocess.Popen(
        cmd, cwd=repo_root, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def train_a_few_steps(proc: subprocess.Popen, workdir: Path) -> set[str]:
    """Wait for 3 logged steps; the segments the run's processes used meanwhile."""
    seen: set[str] = set()
    deadline = time.time() + WAIT_S
    while losses_logged(workdir) < 3 and proc.poll() is None and time.time() < deadline:
        seen |= segments_of(group_members(proc.pid))
        time.sleep(0.1)
    seen |= segments_of(group_members(proc.pid))
    assert losses_logged(workdir) >= 3, proc.stderr.read()[-2000:] if proc.poll() else "no steps"
    return seen


def wait_for_group_to_end(pgid: int) -> list[int]:
    """The group's processes still alive after `WAIT_S` (none: it ended); those are then ended,
    gently first so that Python's resource tracker can still unlink their segments."""
    deadline = time.time() + WAIT_S
    while group_members(pgid) and time.time() < deadline:
        time.sleep(0.1)
    left = group_members(pgid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in group_members(pgid):
            os.kill(pid, sig)
        time.sleep(2)
    return left


def test_a_slurm_preemption_leaves_no_worker_segment_or_warning(corpus, tmp_path, repo_root):
    """Slurm signals every process of the job. The workers used to die of the SIGTERM with a
    batch in hand, and Python's resource tracker warned in the job's log that it cleaned up
    "10 leaked shared_memory objects"; now the trainer ends its workers itself."""
    workdir = tmp_path / "run"
    proc = start_run(corpus, workdir, repo_root)
    seen = train_a_few_steps(proc, workdir)
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=WAIT_S)
    left = wait_for_group_to_end(proc.pid)
    assert proc.returncode == 0, stderr[-2000:]
    assert "stopped by SIGTERM at step" in stderr
    assert "leaked shared_memory" not in stderr, stderr[-1000:]
    assert not left, "worker processes outlived the run"
    assert seen and not seen & set(os.listdir("/dev/shm"))


def test_workers_end_with_a_trainer_that_dies_without_stopping_them(corpus, tmp_path, repo_root):
    """A trainer killed outright (out of memory, `kill -9`, the watchdog's `os._exit`) used to
    leave its workers running forever, their batches in /dev/shm, until a scheduler's SIGKILL
    left those segments there for good."""
    workdir = tmp_path / "run"
    proc = start_run(corpus, workdir, repo_root)
    seen = train_a_few_steps(proc, workdir)
    proc.kill()  # the trainer alone
    proc.wait(timeout=WAIT_S)
    left = wait_for_group_to_end(proc.pid)
    proc.stderr.close()
    assert not left, "worker processes outlived the trainer"
    assert seen and not seen & set(os.listdir("/dev/shm"))


def test_a_run_waits_for_grain_to_unlink_the_batches_it_dropped(corpus):
    """Grain unlinks a dropped worker batch's shared memory in a background thread that the
    interpreter's exit stops with unlinks still queued: Python's resource tracker then warned of
    "leaked shared_memory objects" after most runs with data.workers (2 of 3 tiny runs). A run
    now waits for them; here the thread is held busy so that the unlinks are surely queued."""
    from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

    from input_pipeline.dataset_info import load_dataset_info
    from input_pipeline.pipeline import make_batch_iterator
    from input_pipeline.reading import Reading
    from input_pipeline.workers import wait_for_dropped_batches

    reading = Reading(workers=1)
    it = make_batch_iterator(
        load_dataset_info(corpus), "train", seq_len=64, batch_size=4, reading=reading
    )
    batches = [next(it) for _ in range(3)]
    names = {array.shm.name for batch in batches for array in batch.values()}
    it.close()
    gate = threading.Event()
    SharedMemoryArray._del_thread_pool.apply_async(gate.wait, (WAIT_S,))  # its one thread busy
    del batches  # their unlinks queue behind it
    threading.Timer(0.5, gate.set).start()
    wait_for_dropped_batches()
    assert names and not names & set(os.listdir("/dev/shm"))


class RecordedSegments:
    """A worker iterator's batches, passed on; the names of their shared memory segments and a
    copy of their values kept (never the batches: a reference would keep them in /dev/shm)."""

    def __init__(self, batches):
        self._batches = batches
        self.names: set[str] = set()
        self.values: list[dict[str, np.ndarray]] = []

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._batches)
        self.names.update(array.shm.name for array in batch.values())
        self.values.append({name: np.array(array) for name, array in batch.items()})
        return batch


def test_placed_batches_do_not_hold_worker_shared_memory(corpus):
    """JAX's CPU arrays alias the host arrays they are made from and let go of them only at a
    later transfer: the worker batches a run placed last stayed in /dev/shm past the run's wait
    for Grain's unlinks, until the interpreter's exit, and the resource tracker warned of "30
    leaked shared_memory objects" (process 1 of 2, which makes no transfer after its loop). The
    feed now places copies of them, so a worker batch is gone while its placed arrays live."""
    from input_pipeline.dataset_info import load_dataset_info
    from input_pipeline.device import DeviceFeed
    from input_pipeline.pipeline import make_batch_iterator
    from input_pipeline.reading import Reading
    from input_pipeline.workers import wait_for_dropped_batches

    batches = make_batch_iterator(
        load_dataset_info(corpus), "train", seq_len=64, batch_size=8, reading=Reading(workers=1)
    )
    recorded = RecordedSegments(batches)
    sharding = NamedSharding(jax.make_mesh((8,), ("data",)), PartitionSpec("data"))
    with DeviceFeed(recorded, sharding, prefetch=2) as feed:
        placed = [next(feed)[0] for _ in range(3)]
    batches.close()
    wait_for_dropped_batches()
    held = recorded.names & set(os.listdir("/dev/shm"))
    assert recorded.names and not held, f"{len(held)} worker batch segments held by placed arrays"
    for got, want in zip(placed, recorded.values, strict=False):
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]), want[name])


def test_a_two_process_run_leaves_no_worker_segment_or_warning(
    corpus, tmp_path, tmp_path_factory, repo_root
):
    """launch/local.sh 2 with data.workers=2, to its last step: every session of a Slurm job that
    requeues itself printed "There appear to be 30 leaked shared_memory objects" (see above)."""
    workdir, log_path = tmp_path / "run", tmp_path / "local.log"
    cmd = [str(repo_root / "launch/local.sh"), "2", "--config", "configs/tiny.yaml"]
    cmd += run_args(corpus, workdir, "data.workers=2")
    seen: set[str] = set()
    with reserved_port() as port, log_path.open("w") as log:
        env = cpu_env(**compile_cache(tmp_path_factory), JAX_COORDINATOR_PORT=str(port))
        launcher = subprocess.Popen(
            cmd, cwd=repo_root, env=env, stdout=log, stderr=log, start_new_session=True
        )
        try:
            deadline = time.time() + 5 * WAIT_S
            while launcher.poll() is None and time.time() < deadline:
                seen |= segments_of(group_members(launcher.pid))
                time.sleep(0.1)
        finally:
            end_launcher(launcher, log_path)
    left = wait_for_group_to_end(launcher.pid)
    said = log_path.read_text()
    assert launcher.returncode == 0, said[-3000:]
    assert said.count("finished at step") == 2, said[-3000:]
    assert "leaked shared_memory" not in said, said[-1500:]
    assert not left, "processes outlived the run"
    assert seen and not seen & set(os.listdir("/dev/shm"))
