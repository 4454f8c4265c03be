"""Multi-host on JAX's own runtime, for real: 2 processes x 4 CPU devices (Gloo) against 1 process
x 8 devices, checkpoints crossing process counts, a SIGKILLed peer, the launchers' contracts.

Losses are compared at `RTOL` relative: float32 compute, and the only difference between the runs
is the order in which the cross-process all-reduce adds the gradients (seen: ~1e-7).
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import TINY, compile_cache, documents, flipped_copy, made_once, tiny_run
from jax.experimental import multihost_utils

from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.device import row_block_of
from input_pipeline.errors import DataError
from input_pipeline.prepare import prepare_dataset
from input_pipeline.streams import StreamBatches
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.observe.metrics import read_metrics
from trainer.observe.watchdog import EXIT_STUCK
from trainer.parallel.agreement import check_same_config, check_same_data, check_shared_workdir
from trainer.parallel.distributed import ClusterSpec, cluster_from_env, not_joined
from trainer.preemption import StopRequest
from trainer.train import run

RTOL = 1e-5
STEPS = 6
# Two data streams: the same global batches on 1 or 2 processes. Checkpoints at 3 and 6.
MULTIHOST = [
    *TINY,
    f"run.steps={STEPS}",
    "optim.decay_steps=100",
    "checkpoint.every=3",
    "checkpoint.keep=50",
    f"eval.every={STEPS}",
    "precision.compute=float32",
    "data.streams=2",
    "log.tensorboard=false",
]


# ----------------------------------------------------------------------------- helpers


def run_args(corpus: Path, workdir: Path, *extra: str) -> list[str]:
    return [*MULTIHOST, f"data.path={corpus}", f"run.workdir={workdir}", *extra]


def train_in_process(repo_root: Path, corpus: Path, workdir: Path, *extra: str):
    """One process, the 8 fake devices of conftest.py, through the library."""
    return run(load_config(repo_root / "configs/tiny.yaml", run_args(corpus, workdir, *extra)))


def single_process_baseline(tmp_path_factory, repo_root: Path, corpus: Path) -> Path:
    """The reference run (1 process x 8 devices), trained once per test run for this module and
    test_slurm.py, in whichever xdist worker asks first (`made_once`). Each worker prepares its
    own `corpus`, with the same content (the same dataset fingerprint), so the reference trained
    on one worker's copy is the reference for the other's too."""

    def train(workdir: Path) -> None:
        train_in_process(repo_root, corpus, workdir)

    return made_once(tmp_path_factory, "multihost-baseline", train)


def metrics_of(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"  # read as it is written: its last line may be cut off
    return read_metrics(path).rows if path.exists() else []


def losses_of(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics_of(workdir) if "loss" in r}


def eval_losses_of(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in metrics_of(workdir) if "eval_loss" in r}


def assert_losses_match(got: Path, want: Path, steps) -> None:
    got_losses, want_losses = losses_of(got), losses_of(want)
    np.testing.assert_allclose(
        [got_losses.get(s, np.nan) for s in steps],
        [want_losses[s] for s in steps],
        rtol=RTOL,
        err_msg=f"losses of steps {list(steps)}: {got} vs {want}",
    )


def saved_steps(workdir: Path) -> list[int]:
    """Complete checkpoints (Orbax renames a step folder into place once it is finished)."""
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def copy_checkpoint(src: Path, step: int, dst: Path) -> None:
    shutil.copytree(src / "checkpoints" / str(step), dst / "checkpoints" / str(step))


def free_port() -> int:
    """A port nobody listens on now; anyone may take it once this returns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port for process 0's coordinator that nothing else takes while the test runs. Bound
    with SO_REUSEADDR on every address (IPv6 and IPv4: a hold on 127.0.0.1 alone left [::1]:P
    to others) and never listening, it is skipped by other binds and by the ports the kernel
    gives outgoing connections, while the coordinator (and the port check before it), which bind
    with SO_REUSEADDR too, can still listen there. A `free_port` was anyone's again in the
    seconds before the coordinator bound it, while the other tests connect and bind."""
    with socket.socket(socket.AF_INET6) as holder:
        holder.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("::", 0))
        yield holder.getsockname()[1]


def cpu_env(**extra: str) -> dict[str, str]:
    """This environment minus conftest's 8-device flag (launchers set the device split)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))}
    env["XLA_FLAGS"] = " ".join(
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu", **extra}


def launched_pids(log: Path) -> list[int]:
    """The process ids launch/local.sh announced in its log."""
    started = re.search(r"\d+ processes \(([\d ]+)\)", log.read_text())
    return [int(pid) for pid in started[1].split()] if started else []


def wait_for(done: Callable[[], bool], procs, logs: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        dead = [p.returncode for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(log.read_text()[-1500:] for log in logs)
            pytest.fail(f"processes exited {dead} or timed out before the condition:\n{tails}")
        time.sleep(0.2)


def stacks_of(pids: list[int], log: Path) -> str:
    """Every thread's Python stack in each of `pids`, which write to `log`: `trainer.main` prints
    them on SIGUSR1 and runs on. What a stuck run waits for, before the test kills it. One
    process at a time: two writing at once interleave their lines."""
    stacks = []
    for pid in pids:
        before = len(log.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
        time.sleep(1)
        stacks.append(f"stacks of process {pid} (SIGUSR1):\n{log.read_text()[before:]}")
    return "\n".join(stacks)


def stop_within(launcher: subprocess.Popen, log: Path, timeout: float) -> int:
    """The launcher's status once its processes stopped after a SIGTERM; past `timeout`, a
    failure that keeps what they said and where each one waits (slow, or stuck where)."""
    try:
        return launcher.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        said = log.read_text()
        stacks = stacks_of(launched_pids(log), log)
        pytest.fail(f"no stop within {timeout} s of the SIGTERM:\n{said[-3000:]}\n{stacks}")


def end_launcher(launcher: subprocess.Popen, log: Path) -> None:
    """Kill a launcher still running, and the processes it started: a killed launcher leaves
    them behind."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()
        for pid in launched_pids(log):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, repo_root, corpus) -> Path:
    return single_process_baseline(tmp_path_factory, repo_root, corpus)


@pytest.fixture
def coordinator_port() -> Iterator[int]:
    """A `reserved_port` for this test's process 0 (launch/local.sh: JAX_COORDINATOR_PORT)."""
    with reserved_port() as port:
        yield port


# ----------------------------------------------------------------------------- real runs


@pytest.mark.slow
def test_two_processes_match_one_stop_together_and_resume_on_one(
    baseline, corpus, tmp_path, tmp_path_factory, repo_root, coordinator_port
):
    """launch/local.sh 2 trains on the baseline's batches; SIGTERM to one process (one host
    preempted) stops both after the same step; its checkpoint resumes on one process."""
    two, log_path = tmp_path / "two", tmp_path / "local.log"
    cmd = [str(repo_root / "launch/local.sh"), "2", "--config", "configs/tiny.yaml"]
    cmd += run_args(corpus, two, "run.steps=1000")
    with log_path.open("w") as log:
        env = cpu_env(**compile_cache(tmp_path_factory), JAX_COORDINATOR_PORT=str(coordinator_port))
        launcher = subprocess.Popen(cmd, cwd=repo_root, env=env, stdout=log, stderr=log)
    try:
        wait_for(lambda: max(losses_of(two), default=0) > STEPS, [launcher], [log_path], 300)
        started = re.search(r"2 processes \((\d+) (\d+)\)", log_path.read_text())
        os.kill(int(started[2]), signal.SIGTERM)
        status = stop_within(launcher, log_path, 120)
    finally:
        end_launcher(launcher, log_path)
    log = log_path.read_text()
    assert status == 0, log[-3000:]
    stopped = saved_steps(two)[-1]
    assert f"stopped by SIGTERM at step {stopped}" in log
    assert log.count(f"finished at step {stopped}") == 2, "both processes stopped after it"
    assert [r["step"] for r in metrics_of(two) if "loss" in r] == list(range(1, stopped + 1)), (
        "process 0 alone writes one metrics line per step"
    )
    assert_losses_match(two, baseline, range(1, STEPS + 1))
    np.testing.assert_allclose(eval_losses_of(two)[STEPS], eval_losses_of(baseline)[STEPS], RTOL)

    # Each process read its own stream and saved its own position.
    data = two / "checkpoints" / "3" / "data"
    for index in range(2):
        state = json.loads((data / f"process_{index}-of-2.json").read_text())
        assert state["streams"] == 2 and list(state["positions"]) == [str(index)]

    # Written by 2 processes, resumed by 1: the same losses as the straight runs.
    resumed = tmp_path / "two_then_one"
    copy_checkpoint(two, 3, resumed)
    train_in_process(repo_root, corpus, resumed, "data.streams=null")  # streams from checkpoint
    assert sorted(losses_of(resumed)) == [4, 5, 6], "resumed at step 3"
    assert_losses_match(resumed, baseline, range(4, STEPS + 1))
    np.testing.assert_allclose(eval_losses_of(resumed)[STEPS], eval_losses_of(two)[STEPS], RTOL)


def test_only_the_loop_asks_jax_where_to_stop_counting_this_sessions_steps(
    corpus, tmp_path, monkeypatch
):
    """JAX's preemption sync keeps, per process, the count of the latest question and stops every
    process one past the furthest count: the loop asks once per step (`StopRequest.at_step`) and
    nothing else may. Orbax's manager asked again, from its finalize thread with the step of an
    earlier save: process 0's count went back, the sync picked step 12 after its loop had asked
    about 12, and it trained on alone into step 13's collective while process 1 stopped (the
    two-process stop test hung once that way; forced, it hangs every time). The count is this
    session's steps: before the first question JAX counts 0, so with the run's step a notice
    during a resumed session's start-up named step 1, which that loop never reached, and the run
    trained on to `run.steps`. Here, in one process, the stop request asks as it does with
    several, and every question is recorded."""
    asked: list[tuple[str, int]] = []

    def record(count: int) -> bool:
        asked.append((threading.current_thread().name, count))
        return False

    def as_with_several_processes(self: StopRequest) -> None:
        real_init(self)
        self._multihost = True

    real_init = StopRequest.__init__
    monkeypatch.setattr(StopRequest, "__init__", as_with_several_processes)
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", record)
    run(tiny_run(corpus, tmp_path / "run", steps=4))  # saves at 0 (its warm-up), 2 and 4
    assert asked == [("MainThread", count) for count in range(1, 5)]
    asked.clear()
    run(tiny_run(corpus, tmp_path / "run", steps=6))  # resumes at 4
    assert asked == [("MainThread", 1), ("MainThread", 2)]


@pytest.mark.slow
def test_a_sigterm_during_a_resumed_start_up_stops_both_after_their_first_step(
    baseline, corpus, tmp_path, tmp_path_factory, repo_root, coordinator_port
):
    """launch/local.sh 2 resumes the baseline's step 3, and process 1 gets a SIGTERM while the
    two still restore and compile (as a Slurm time-limit warning or a preemption may land in a
    requeued job's start-up): both stop after their first step, 4, and save it. JAX counted
    the run's steps before: the notice named step 1, which this loop never reached, and the run
    trained on to `run.steps` as if nothing had come."""
    workdir, log_path = tmp_path / "resumed", tmp_path / "local.log"
    copy_checkpoint(baseline, 3, workdir)
    cmd = [str(repo_root / "launch/local.sh"), "2", "--config", "configs/tiny.yaml"]
    cmd += run_args(corpus, workdir, "run.steps=40", "eval.every=1000", "checkpoint.every=1000")
    with log_path.open("w") as log:
        env = cpu_env(**compile_cache(tmp_path_factory), JAX_COORDINATOR_PORT=str(coordinator_port))
        launcher = subprocess.Popen(cmd, cwd=repo_root, env=env, stdout=log, stderr=log)
    try:

        def joined() -> bool:
            """Both processes joined the runtime, whose preemption service takes SIGTERM from
            there on: their first collective connects Gloo, which says so. Not "[Gloo] Rank 1
            is connected": Gloo writes that line in pieces, from a thread per connection, and
            two of them can interleave (see test_processes_given_different_configs...)."""
            return "[Gloo] Rank " in log_path.read_text()

        wait_for(joined, [launcher], [log_path], 300)  # then checks, restore, compile: seconds
        assert not losses_of(workdir), "the SIGTERM was meant for the start-up"
        os.kill(launched_pids(log_path)[1], signal.SIGTERM)
        status = stop_within(launcher, log_path, 120)
    finally:
        end_launcher(launcher, log_path)
    log = log_path.read_text()
    assert status == 0, log[-3000:]
    assert "stopped by SIGTERM at step 4" in log, log[-3000:]
    assert log.count("finished at step 4 of 40: stopped early") == 2, "both stopped after it"
    assert saved_steps(workdir) == [3, 4]
    assert_losses_match(workdir, baseline, [4])


def accepts(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port`."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


@pytest.mark.slow
def test_a_sigterm_before_the_processes_joined_is_one_line_from_each(
    tmp_path, repo_root, coordinator_port
):
    """A SIGTERM to launch/local.sh (so to each process, as slurm.sbatch's time-limit warning
    reaches every task) while the processes still join JAX's runtime: process 0 waits in
    JAX's connect for process 1, which still waits for its coordinator (here one that never
    answers). Each ends at once with its own start-up line and exit 0, as one process does, and
    so does the launcher. They were killed by the signal without a word (143), and a Python
    handler alone would not run until JAX's connect returned: when every peer came, or never."""
    workdir, log_path = tmp_path / "run", tmp_path / "local.log"
    port = coordinator_port
    with socket.socket() as nowhere:
        nowhere.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        python = tmp_path / "python"  # process 1 joins a coordinator that never answers
        python.write_text(
            f'#!/bin/sh\n[ "$JAX_PROCESS_ID" = 1 ] && '
            f"export JAX_COORDINATOR_ADDRESS=127.0.0.1:{nowhere.getsockname()[1]}\n"
            f'exec {sys.executable} "$@"\n'
        )
        python.chmod(0o755)
        cmd = [str(repo_root / "launch/local.sh"), "2", "--config", "configs/tiny.yaml"]
        cmd += [*TINY, f"run.workdir={workdir}", "log.tensorboard=false"]
        env = cpu_env(PYTHON=str(python), JAX_COORDINATOR_PORT=str(port), LOCAL_DEVICE="cpu")
        with log_path.open("w") as log:
            launcher = subprocess.Popen(cmd, cwd=repo_root, env=env, stdout=log, stderr=log)
        try:

            def both_joining() -> bool:  # process 0's coordinator is up: it is in JAX's connect
                return log_path.read_text().count("joining the cluster") == 2 and accepts(port)

            wait_for(both_joining, [launcher], [log_path], 120)
            launcher.send_signal(signal.SIGTERM)
            status = stop_within(launcher, log_path, 60)
        finally:
            end_launcher(launcher, log_path)
    log = log_path.read_text()
    assert status == 0, log[-3000:]
    stops = [x for x in log.splitlines() if x.startswith("stopped by SIGTERM during start-up")]
    assert len(stops) == 2, log[-3000:]
    for index in range(2):
        [line] = [x for x in stops if f"as process {index} of 2;" in x]
        assert line.startswith(
            "stopped by SIGTERM during start-up, before this session's first step, while "
            "joining the cluster at 127.0.0.1:"
        ), line
    assert "Traceback" not in log and "exited with status" not in log, log[-3000:]
    assert not (workdir / "checkpoints").exists()


@pytest.mark.slow
def test_killed_process_stops_its_peer_and_the_rerun_resumes(
    baseline, corpus, tmp_path, tmp_path_factory, repo_root, coordinator_port, capsys
):
    """Two processes started by hand (no launcher to clean up after them) resume a checkpoint
    written by one process; one is SIGKILLed; the runtime must end the other."""
    workdir = tmp_path / "killed"
    copy_checkpoint(baseline, 3, workdir)
    cmd = [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml"]
    cmd += run_args(corpus, workdir, "run.steps=1000", "eval.every=1000")
    address = f"127.0.0.1:{coordinator_port}"
    procs, logs = [], []
    for index in range(2):
        env = cpu_env(
            **compile_cache(tmp_path_factory),
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
            JAX_COORDINATOR_ADDRESS=address,
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(index),
        )
        logs.append(tmp_path / f"process{index}.log")
        with logs[-1].open("w") as log:
            procs.append(
                subprocess.Popen(cmd, cwd=repo_root, env=env, stdout=log, stderr=log, text=True)
            )
    try:
        wait_for(lambda: max(losses_of(workdir), default=0) >= 8, procs, logs, timeout=300)
        procs[1].kill()
        killed_at = time.monotonic()
        status = procs[0].wait(timeout=120)
        took = time.monotonic() - killed_at
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    with capsys.disabled():
        print(f"\nsurvivor exited with status {status} {took:.1f} s after its peer was killed")
    assert status != 0, logs[0].read_text()[-2000:]
    assert took < 60
    # Written by 1 process, resumed by 2: the same losses as the straight run.
    assert_losses_match(workdir, baseline, range(4, STEPS + 1))

    # The rerun (here: one process) resumes from the latest complete checkpoint.
    before = losses_of(workdir)
    latest = saved_steps(workdir)[-1]
    assert latest >= 6
    capsys.readouterr()
    result = train_in_process(
        repo_root, corpus, workdir, f"run.steps={latest + 2}", "eval.every=1000"
    )
    assert f"(step {latest})" in capsys.readouterr().err
    assert result.step == latest + 2
    after = losses_of(workdir)
    kept = [s for s in before if s <= latest]  # lines up to the checkpoint stay as they were
    assert kept and {s: after[s] for s in kept} == {s: before[s] for s in kept}
    redone = [s for s in (latest + 1, latest + 2) if s in before]
    np.testing.assert_allclose([after[s] for s in redone], [before[s] for s in redone], RTOL)


@pytest.mark.slow
def test_a_stopped_peer_trips_the_watchdog_and_the_rerun_resumes(
    baseline, corpus, tmp_path, tmp_path_factory, repo_root, coordinator_port, capsys
):
    """launch/local.sh 2 resumes the baseline's step 3; process 1 is SIGSTOPped (alive but stuck,
    as in a hung collective: its heartbeats stop only because the test stops it whole, so the
    heartbeat timeout is raised above the step timeout). Process 0's watchdog writes its stacks
    and exits, the launcher kills the stopped one, and the rerun ends on the clean run's losses."""
    timeout_s, heartbeat_s = 10, 60
    workdir, log_path = tmp_path / "stuck", tmp_path / "local.log"
    copy_checkpoint(baseline, 3, workdir)
    cmd = [str(repo_root / "launch/local.sh"), "2", "--config", "configs/tiny.yaml"]
    cmd += run_args(corpus, workdir, "run.steps=1000", "eval.every=1000", "checkpoint.every=1000")
    cmd += [f"run.step_timeout_s={timeout_s}"]
    env = cpu_env(
        **compile_cache(tmp_path_factory),
        JAX_COORDINATOR_PORT=str(coordinator_port),
        JAX_HEARTBEAT_TIMEOUT_S=str(heartbeat_s),
        LOCAL_KILL_GRACE_S="2",
    )
    with log_path.open("w") as log:
        launcher = subprocess.Popen(cmd, cwd=repo_root, env=env, stdout=log, stderr=log)
    try:
        wait_for(lambda: max(losses_of(workdir), default=0) >= 5, [launcher], [log_path], 300)
        os.kill(launched_pids(log_path)[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        status = launcher.wait(timeout=timeout_s + heartbeat_s + 60)
        took = time.monotonic() - stopped_at
    finally:
        end_launcher(launcher, log_path)
    log = log_path.read_text()
    with capsys.disabled():
        print(f"\nlauncher exited with status {status} {took:.1f} s after a peer was stopped")
    assert status == EXIT_STUCK, log[-3000:]
    assert took < timeout_s + heartbeat_s
    [line] = [x for x in log.splitlines() if x.startswith("error: watchdog (process 0 of 2)")]
    assert f"(limit {timeout_s} s, run.step_timeout_s)" in line
    assert "most recent call first" in log, "the stuck process's Python stacks"
    assert "process 1" not in line

    # The rerun (one process here) resumes from step 3 and ends on the clean run's losses.
    capsys.readouterr()
    train_in_process(repo_root, corpus, workdir)
    assert "(step 3)" in capsys.readouterr().err
    assert sorted(losses_of(workdir)) == [4, 5, 6], "no duplicated or missing metrics lines"
    assert_losses_match(workdir, baseline, range(4, STEPS + 1))


# ----------------------------------------------------------------------------- launchers


def test_local_launcher_sets_the_runtime_variables_and_stops_all_when_one_fails(
    tmp_path, repo_root
):
    """launch/local.sh with a stand-in interpreter: process 1 fails, process 0 would run on."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = -c ] && exec {sys.executable} "$@"\n'  # the launcher's free-port probe
        f'env | grep -E "^(JAX_|XLA_FLAGS)" > {tmp_path}/env.$JAX_PROCESS_ID\n'
        '[ "$JAX_PROCESS_ID" = 1 ] && { sleep 1; exit 3; }\n'
        f"echo $$ > {tmp_path}/pid.$JAX_PROCESS_ID\n"
        "exec sleep 120\n"
    )
    fake.chmod(0o755)
    env = cpu_env(PYTHON=str(fake), LOCAL_KILL_GRACE_S="5", LOCAL_DEVICE="cpu")
    start = time.monotonic()
    done = subprocess.run(
        [str(repo_root / "launch/local.sh"), "2", "--config", "x.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert time.monotonic() - start < 20
    with pytest.raises(ProcessLookupError):  # the survivor was stopped (and reaped)
        os.kill(int((tmp_path / "pid.0").read_text()), 0)
    seen = [
        dict(line.split("=", 1) for line in (tmp_path / f"env.{i}").read_text().splitlines())
        for i in range(2)
    ]
    assert [s["JAX_PROCESS_ID"] for s in seen] == ["0", "1"]
    assert {s["JAX_NUM_PROCESSES"] for s in seen} == {"2"}
    assert len({s["JAX_COORDINATOR_ADDRESS"] for s in seen}) == 1
    assert seen[0]["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
    assert seen[0]["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4"]


def test_local_launcher_lets_ctrl_c_reach_its_processes(tmp_path, repo_root):
    """Each process starts with SIGINT's default action, as the launcher has it from a terminal:
    bash starts a script's background jobs with SIGINT ignored, and Python keeps that, so a
    Ctrl-C before the training loop (which handles SIGINT itself) was lost on them."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = -c ] && exec {sys.executable} "$@"\n'  # the launcher's free-port probe
        f"exec {sys.executable} -c 'import signal; print(signal.getsignal(signal.SIGINT))' "
        f"> {tmp_path}/sigint.$JAX_PROCESS_ID\n"
    )
    fake.chmod(0o755)
    env = cpu_env(PYTHON=str(fake), LOCAL_DEVICE="cpu")
    done = subprocess.run(
        with_default_sigint([str(repo_root / "launch/local.sh"), "2"]),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    said = [(tmp_path / f"sigint.{i}").read_text().strip() for i in range(2)]
    assert said == ["<built-in function default_int_handler>"] * 2


@pytest.mark.parametrize(
    ("count", "knobs", "message"),
    [
        ("two", {}, "local.sh: N=two is not a whole number >= 1; give N as one (usage: "),
        ("0", {}, "local.sh: N=0 is not a whole number >= 1;"),
        ("2", {"LOCAL_CPU_DEVICES": "0"}, "LOCAL_CPU_DEVICES=0 is not a whole number >= 1;"),
        ("2", {"LOCAL_CPU_DEVICES": "eight"}, "LOCAL_CPU_DEVICES=eight is not a whole number"),
        ("2", {"JAX_COORDINATOR_PORT": "auto"}, "JAX_COORDINATOR_PORT=auto is not a whole"),
        ("2", {"LOCAL_KILL_GRACE_S": "ten"}, "LOCAL_KILL_GRACE_S=ten is not a number of"),
        ("2", {"PYTHON": "no-such-python"}, "PYTHON=no-such-python is not a command here;"),
    ],
)
def test_local_launcher_refuses_bad_knobs_in_one_line(tmp_path, repo_root, count, knobs, message):
    """A bad count or knob stops the launcher before any process starts (LOCAL_CPU_DEVICES=0
    made every process segfault; a word there, an unbound-variable error and exit 1)."""
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\ntouch {tmp_path}/ran\n'
    )
    fake.chmod(0o755)
    env = cpu_env(**{"PYTHON": str(fake), "LOCAL_DEVICE": "cpu", **knobs})
    done = subprocess.run(
        [str(repo_root / "launch/local.sh"), count, "--config", "x.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "ran").exists()


def test_kubernetes_manifest_gives_each_pod_what_the_runtime_needs(repo_root):
    docs = list(yaml.safe_load_all((repo_root / "launch/k8s/trainer.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    assert service["spec"]["clusterIP"] == "None", "a headless Service gives pods DNS names"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    assert pod["subdomain"] == service["metadata"]["name"]
    [container] = pod["containers"]
    assert container["command"][:3] == ["python", "-m", "trainer.main"]
    env = {e["name"]: e for e in container["env"]}

    # Each pod's environment as Kubernetes fills it: the completion index from its annotation.
    index_path = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == index_path
    specs = [
        cluster_from_env(
            {name: e.get("value", str(index)) for name, e in env.items()}
            | {"JOB_COMPLETION_INDEX": str(index)}
        )
        for index in range(spec["completions"])
    ]
    host, port = specs[0].coordinator_address.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}", "pod 0's name"
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    assert {s.num_processes for s in specs} == {spec["parallelism"]}
    assert sorted(s.process_id for s in specs) == list(range(spec["completions"]))
    assert len({s.coordinator_address for s in specs}) == 1


def test_launch_scripts_only_set_variables_and_start_processes(repo_root):
    for script in ["local.sh", "slurm.sbatch", "tpu_pod.sh"]:
        text = (repo_root / "launch" / script).read_text()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert not any(word in code for word in ("pip ", "apt-get", "conda ", "uv ")), script
    sbatch = (repo_root / "launch/slurm.sbatch").read_text()
    assert "srun" in sbatch and "-m trainer.main" in sbatch and "--config" in sbatch
    assert "--worker=all" in (repo_root / "launch/tpu_pod.sh").read_text()


# -------------------------------------------------------------------- parallel/distributed.py


def test_cluster_from_environment():
    explicit = {"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "4"}
    assert cluster_from_env({}) is None
    assert cluster_from_env({**explicit, "JAX_PROCESS_ID": "2"}) == ClusterSpec(
        "explicit", "h0:1234", 4, 2
    )
    assert cluster_from_env({**explicit, "JOB_COMPLETION_INDEX": "3"}).process_id == 3
    assert cluster_from_env({**explicit, "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}) is None
    timed = cluster_from_env({**explicit, "JAX_PROCESS_ID": "0", "JAX_HEARTBEAT_TIMEOUT_S": "7"})
    assert timed.heartbeat_timeout_s == 7
    slurm_step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}
    assert cluster_from_env(slurm_step) == ClusterSpec("slurm")
    assert cluster_from_env({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}) is None, "batch script"
    assert cluster_from_env({**slurm_step, "SLURM_STEP_NUM_TASKS": "1"}) is None
    assert cluster_from_env({"JAX_DISTRIBUTED_AUTO": "1"}) == ClusterSpec("auto")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"JAX_COORDINATOR_ADDRESS": "h0:1", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES is not"),
        ({"JAX_COORDINATOR_ADDRESS": "h0:1", "JAX_NUM_PROCESSES": "2"}, "JAX_PROCESS_ID is not"),
        ({"JAX_COORDINATOR_ADDRESS": "h0", "JAX_NUM_PROCESSES": "2"}, "has no port"),
        (
            {"JAX_COORDINATOR_ADDRESS": "h0:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
            "outside 0..1",
        ),
        ({"JAX_COORDINATOR_ADDRESS": "h0:1", "JAX_NUM_PROCESSES": "two"}, "not an integer"),
        ({"JAX_COORDINATOR_ADDRESS": "h0:http", "JAX_NUM_PROCESSES": "2"}, "no valid port"),
        ({"JAX_COORDINATOR_ADDRESS": "h0:0", "JAX_NUM_PROCESSES": "2"}, "no valid port"),
    ],
)
def test_bad_cluster_variables_are_one_line(environ, message):
    with pytest.raises(ConfigError, match=message):
        cluster_from_env(environ)


def test_a_slurm_task_still_waiting_at_the_init_timeout_is_told_to_check_the_others():
    """The line a task of an `srun` step ends with when its peers have not all joined (JAX would
    abort it 5 s later); the explicit cluster's lines are checked with real processes below."""
    assert not_joined(ClusterSpec("slurm", init_timeout_s=60)) == (
        "could not join the slurm-detected cluster: not every task of the srun step joined "
        "within JAX_INIT_TIMEOUT_S=60 s (JAX does not say which); check that every task "
        "started, or raise JAX_INIT_TIMEOUT_S"
    )


def tiny_cli(repo_root: Path, workdir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m trainer.main` on the tiny config as one process of a cluster `env` describes."""
    return subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml"]
        + [f"run.workdir={workdir}"],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_unreachable_coordinator_fails_within_the_init_timeout(tmp_path, repo_root):
    """A peer whose process 0 never comes up says so in one line (JAX's own abort printed a
    stack trace blaming "another task" that died)."""
    port = free_port()  # nobody listens there
    env = cpu_env(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES="2",
        JAX_PROCESS_ID="1",
        JAX_INIT_TIMEOUT_S="2",
    )
    start = time.monotonic()
    done = tiny_cli(repo_root, tmp_path, env)
    assert done.returncode != 0 and "joined" not in done.stdout
    assert "joining the cluster at 127.0.0.1:" in done.stderr
    assert time.monotonic() - start < 30
    assert done.returncode == 2
    assert done.stderr.splitlines()[1:] == [
        f"error: process 0's coordinator at 127.0.0.1:{port} did not answer within 2 s "
        "(JAX_INIT_TIMEOUT_S); start process 0 (JAX_PROCESS_ID=0) on that host, or fix "
        "JAX_COORDINATOR_ADDRESS"
    ]


def cluster_cli(repo_root: Path, workdir: Path, env: dict[str, str]) -> subprocess.Popen:
    """`tiny_cli` started, not waited for; its stderr is a pipe."""
    cmd = [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml"]
    cmd += [f"run.workdir={workdir}"]
    return subprocess.Popen(
        cmd, cwd=repo_root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def with_default_sigint(cmd: list[str]) -> list[str]:
    """`cmd` with SIGINT's default action, as a terminal's foreground job has it: a shell without
    job control starts a background job (maybe this test run) with SIGINT ignored, which every
    process it starts inherits, and then Python raises no KeyboardInterrupt."""
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    return [sys.executable, "-c", reset + "os.execv(sys.argv[1], sys.argv[1:])", *cmd]


@pytest.mark.slow
def test_a_process_whose_peer_never_joins_says_so_in_one_line(
    tmp_path, repo_root, coordinator_port
):
    """Process 0 of 2 started alone (or its peer stopped during its start-up) ends with one line
    at JAX_INIT_TIMEOUT_S. JAX aborted it 5 s later (SIGABRT) with a C++ stack trace blaming
    "another task"."""
    port = coordinator_port
    env = cpu_env(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES="2",
        JAX_PROCESS_ID="0",
        JAX_INIT_TIMEOUT_S="5",
    )
    done = tiny_cli(repo_root, tmp_path, env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines()[1:] == [
        f"error: could not join the cluster at 127.0.0.1:{port} as process 0 of 2: process 1 "
        "did not join within JAX_INIT_TIMEOUT_S=5 s; start process 1 (JAX_PROCESS_ID=1) with "
        "the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES, or raise JAX_INIT_TIMEOUT_S"
    ], done.stderr[-3000:]


@pytest.mark.slow
def test_processes_waiting_for_one_that_never_comes_each_say_so(
    tmp_path, repo_root, coordinator_port
):
    """Processes 0 and 1 of 3, process 2 never started: each ends with one line at its own
    JAX_INIT_TIMEOUT_S, whichever ends first (a peer's connect outlives a process 0 that ended:
    it retries until its own time is up)."""
    port = coordinator_port
    env = cpu_env(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES="3",
        JAX_INIT_TIMEOUT_S="10",
    )
    procs = [
        cluster_cli(repo_root, tmp_path / str(index), {**env, "JAX_PROCESS_ID": str(index)})
        for index in range(2)
    ]
    try:
        said = [proc.communicate(timeout=120)[1] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for index, (proc, stderr) in enumerate(zip(procs, said, strict=True)):
        assert proc.returncode == 2, stderr[-3000:]
        assert stderr.splitlines()[1:] == [
            f"error: could not join the cluster at 127.0.0.1:{port} as process {index} of 3: "
            "not every process joined within JAX_INIT_TIMEOUT_S=10 s (JAX does not say which); "
            "start every process (JAX_PROCESS_ID 0..2) with the same JAX_COORDINATOR_ADDRESS and "
            "JAX_NUM_PROCESSES, or raise JAX_INIT_TIMEOUT_S"
        ], stderr[-3000:]


@pytest.mark.slow
def test_ctrl_c_while_waiting_for_the_other_processes_is_one_line(
    tmp_path, repo_root, coordinator_port
):
    """Ctrl-C on process 0 while its connect waits for process 1 ends it with one line. It
    said it was interrupted, then JAX's exit-time shutdown of its coordination service waited
    5 s for that connect to give up and logged the failed registration."""
    port = coordinator_port
    env = cpu_env(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES="2",
        JAX_PROCESS_ID="0",
        JAX_INIT_TIMEOUT_S="300",
    )
    cmd = [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml"]
    cmd += [f"run.workdir={tmp_path}"]
    proc = subprocess.Popen(
        with_default_sigint(cmd), cwd=repo_root, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: accepts(port), [proc], [], 120)  # its coordinator is up: it connects
        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.splitlines()[1:] == [
        f"interrupted without saving while joining the cluster at 127.0.0.1:{port} as process 0 "
        "of 2; re-run the same command to start (or resume from the latest checkpoint)"
    ], stderr[-3000:]


def test_a_coordinator_port_in_use_is_one_line(tmp_path, repo_root):
    """Process 0 on a port something else listens on (JAX's coordination service segfaults)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = cpu_env(
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID="0",
            JAX_INIT_TIMEOUT_S="5",
        )
        done = tiny_cli(repo_root, tmp_path, env)
    errors = [line for line in done.stderr.splitlines() if not line.startswith("joining ")]
    assert done.returncode == 2, done.stderr
    assert errors == [
        f"error: port {port} of JAX_COORDINATOR_ADDRESS=127.0.0.1:{port} is already in use on "
        "process 0's host; stop what holds it or choose a free port "
        "(launch/local.sh: JAX_COORDINATOR_PORT)"
    ]


def test_a_slurm_task_missing_variables_jax_needs_names_them(tmp_path, repo_root):
    """An `srun` task whose container passed only some SLURM_* (JAX said "coordinator_address
    should be defined")."""
    env = cpu_env(
        SLURM_STEP_ID="0",
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_JOB_ID="77",
        SLURM_STEP_NODELIST="localhost",
        SLURM_LOCALID="1",
        JAX_INIT_TIMEOUT_S="5",
    )
    done = tiny_cli(repo_root, tmp_path, env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[1:] == [
        "error: could not join the slurm-detected cluster: this task lacks SLURM_NTASKS; pass "
        "every SLURM_* variable into the task (e.g. its container), or set "
        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID"
    ]


AGREE_ON_CONFIG = """
import os
import sys
from trainer.errors import ConfigError, TrainingError
from trainer.parallel.agreement import check_same_config, check_shared_workdir
from trainer.parallel.distributed import cluster_from_env, initialize

folder, said = sys.argv[1:]
said = open(said, "w", buffering=1)  # stdout also carries Gloo's lines, written in pieces
initialize(cluster_from_env())
me = os.environ["JAX_PROCESS_ID"]
check_same_config({"run": {"workdir": "/w", "steps": 3}, "optim": {"lr": 0.1}})
print("same configs agree", file=said)
try:
    check_same_config({"run": {"workdir": "/w" + me, "steps": 3}, "optim": {"lr": 0.1}})
except ConfigError as err:
    print(f"error: {err}", file=said)
check_shared_workdir(folder + "/shared")
print("a shared workdir passes", file=said)
try:  # each process its own folder: what a host-local disk at the same path looks like
    check_shared_workdir(folder + "/local" + me, wait_s=0.5)
except ConfigError as err:
    print(f"error: {err}", file=said)
try:  # a folder under a file: process 0 cannot make it, and every process stops
    check_shared_workdir(folder + "/agree.py/run")
except TrainingError as err:
    print(f"error: {err}", file=said)
"""


def on_two_joined_processes(
    repo_root: Path, args: list[list[str]], devices: int
) -> tuple[list[int], list[str]]:
    """Python run with `args[i]` as process i of 2, joined on a reserved port with `devices`
    CPU devices each: their exit statuses, and what each printed (stdout and stderr)."""
    with reserved_port() as port:
        env = cpu_env(
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
            PYTHONPATH=str(repo_root),
        )
        procs = [
            subprocess.Popen(
                [sys.executable, *process_args],
                cwd=repo_root,
                env={**env, "JAX_PROCESS_ID": str(i)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i, process_args in enumerate(args)
        ]
        try:
            printed = [p.communicate(timeout=120)[0] for p in procs]
        finally:  # a timeout: JAX's handler takes SIGTERM, so only SIGKILL ends them
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return [p.returncode for p in procs], printed


def test_processes_given_different_configs_or_workdirs_are_told_so(tmp_path, repo_root):
    """Another `run.workdir` on one process, or the same path on a host-local disk, hangs the
    first checkpoint save; every process says so instead (and the shared folder is left clean).
    Each process writes what it says to its own file: Gloo writes "[Gloo] Rank N is connected
    ..." to stdout in pieces, from a thread per connection, and two such lines interleaved into
    lines without "[Gloo]" (a stray "1", an empty line) that a filter of stdout kept."""
    assert check_same_config({"run": {"workdir": "/w"}}) is None, "a single process: no-op"
    assert check_shared_workdir(tmp_path / "alone") is None
    script = tmp_path / "agree.py"
    script.write_text(AGREE_ON_CONFIG)
    said = [tmp_path / f"said{i}.txt" for i in range(2)]
    statuses, printed = on_two_joined_processes(
        repo_root, [[str(script), str(tmp_path), str(said[i])] for i in range(2)], devices=2
    )
    assert statuses == [0, 0], printed
    assert [path.read_text().splitlines() for path in said] == [
        [
            "same configs agree",
            f"error: process 1's config differs from process 0's in run.workdir (process {i} "
            f"has run.workdir='/w{i}'); give every process the same --config file and overrides",
            "a shared workdir passes",
            f"error: run.workdir={tmp_path}/local{i} is not one shared folder: process(es) 1 do "
            "not see the file process 0 wrote there; put run.workdir on storage every host "
            "mounts at the same path (NFS, Lustre, ...)",
            f"error: process 0 cannot write run.workdir={tmp_path}/agree.py/run"
            + (": Not a directory" if i == 0 else " (process 0's log says why)")
            + "; choose a writable folder",
        ]
        for i in range(2)
    ], printed
    assert list((tmp_path / "shared").iterdir()) == []


# ----------------------------------------------------------------------------- data streams


class CountingStream:
    """A stand-in Grain iterator: rows `100 * stream + batch number`, with a position."""

    def __init__(self, stream: int, length: int | None = None):
        self.stream, self.length, self.position = stream, length, 0

    def __next__(self) -> dict[str, np.ndarray]:
        if self.length is not None and self.position >= self.length:
            raise StopIteration
        value = 100 * self.stream + self.position
        self.position += 1
        return {"inputs": np.full((2, 3), value), "weights": np.ones((2, 3), np.float32)}

    def get_state(self) -> dict[str, int]:
        return {"position": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def global_batches(streams: int, processes: int, count: int, **kw) -> list[np.ndarray]:
    """What `make_array_from_process_local_data` assembles: process 0's rows, then 1's..."""
    per_process = [
        StreamBatches(lambda s, n: CountingStream(s, **kw), streams, p, processes)
        for p in range(processes)
    ]
    return [np.concatenate([next(b)["inputs"] for b in per_process]) for _ in range(count)]


def test_global_batches_do_not_depend_on_the_process_count():
    one = global_batches(4, 1, 3)
    for processes in (2, 4):
        other = global_batches(4, processes, 3)
        assert all(np.array_equal(a, b) for a, b in zip(one, other, strict=True))
    assert one[1][:, 0].tolist() == [1, 1, 101, 101, 201, 201, 301, 301]
    with pytest.raises(DataError, match="do not split over 3 processes"):
        StreamBatches(CountingStream, 4, 0, 3)


def test_stream_positions_resume_on_another_process_count():
    two = [StreamBatches(lambda s, n: CountingStream(s), 4, p, 2) for p in range(2)]
    for batches in two:
        next(batches), next(batches)
    saved = [b.get_state() for b in two]
    merged = {"streams": 4, "positions": saved[0]["positions"] | saved[1]["positions"]}

    one = StreamBatches(lambda s, n: CountingStream(s), 1, 0, 1, pinned=False)
    one.set_state(merged)  # adopts the checkpoint's 4 streams
    assert one.streams == 4
    assert next(one)["inputs"][:, 0].tolist() == [2, 2, 102, 102, 202, 202, 302, 302]
    pinned = StreamBatches(lambda s, n: CountingStream(s), 2, 0, 1, pinned=True)
    with pytest.raises(DataError, match="set data.streams=4"):
        pinned.set_state(merged)


def test_a_stream_count_that_cannot_split_over_the_processes_names_the_checkpoint():
    """A 1-stream checkpoint resumed on 2 processes advised data.streams=2, which the resume then
    refused, advising data.streams=1: the way out is the process count."""
    one = StreamBatches(lambda s, n: CountingStream(s), 1, 0, 1)
    next(one)
    two = StreamBatches(lambda s, n: CountingStream(s), 2, 0, 2, pinned=False)
    with pytest.raises(DataError) as info:
        two.set_state(one.get_state())
    assert str(info.value) == (
        "the checkpoint's data position has 1 data streams, which do not split over 2 "
        "processes; resume on a process count that divides 1 (a new run keeps any process "
        "count that divides its data.streams)"
    )


def test_finished_eval_streams_pad_with_zero_weight_rows():
    batches = StreamBatches(
        lambda s, n: CountingStream(s, length=1 + s), 2, 0, 1, pad_exhausted=True
    )
    weights = [next(batches)["weights"][:, 0].tolist() for _ in range(3)]
    assert weights == [[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]]


@pytest.mark.slow
def test_pipeline_stages_on_two_hosts_match_one(
    baseline, corpus, tmp_path, tmp_path_factory, repo_root, coordinator_port
):
    """launch/local.sh 2 with mesh.stage=2: each host is one stage and, outside the pipeline,
    holds its own half of the batch's rows, so each reads its own stream; the losses are the
    one-process run's."""
    staged, log_path = tmp_path / "staged", tmp_path / "local.log"
    cmd = [str(repo_root / "launch/local.sh"), "2", "--config", "configs/tiny.yaml"]
    cmd += run_args(corpus, staged, "mesh.stage=2", "mesh.data=4")
    with log_path.open("w") as log:
        env = cpu_env(**compile_cache(tmp_path_factory), JAX_COORDINATOR_PORT=str(coordinator_port))
        status = subprocess.run(cmd, cwd=repo_root, env=env, stdout=log, stderr=log, timeout=600)
    log = log_path.read_text()
    assert status.returncode == 0, log[-3000:]
    assert "pipeline 2 stages x 4 microbatches" in log
    assert_losses_match(staged, baseline, range(1, STEPS + 1))
    for index in range(2):
        state = json.loads(
            (staged / "checkpoints/3/data" / f"process_{index}-of-2.json").read_text()
        )
        assert list(state["positions"]) == [str(index)]


def test_processes_holding_the_same_rows_feed_the_same_rows():
    """Row spans of 2 processes: distinct (data parallel across hosts) or the same (an axis
    the batch is replicated over, spanning hosts); anything else is a one-line error."""
    assert row_block_of({0: (0, 8), 1: (8, 16)}, 1, 16) == (1, 2)
    assert row_block_of({0: (0, 16), 1: (0, 16)}, 1, 16) == (0, 1)
    assert row_block_of({0: (8, 16), 1: (0, 8), 2: (8, 16), 3: (0, 8)}, 2, 16) == (1, 2)
    with pytest.raises(DataError, match="do not tile its 16 rows evenly"):
        row_block_of({0: (0, 4), 1: (4, 16)}, 0, 16)


# ----------------------------------------------------------------------------- one dataset


def on_two_hosts(tmp_path: Path, repo_root: Path, copies: list[Path]) -> list[tuple[int, str]]:
    """Exit status and stderr of `python -m trainer.main` on the tiny config as 2 processes, each
    in its own folder whose `data` is `copies[i]`, all given the same relative `data.path=data`:
    what two hosts' local copies of the dataset at one path look like. Each has a cache folder
    of its own, so their records of checked shards start empty, whatever other tests checked."""
    args = ["run.steps=2", "data.cache_dir=cache"]
    with started_on_two_hosts(tmp_path, repo_root, copies, *args) as procs:
        said = [proc.communicate(timeout=120)[1] for proc in procs]
    return [(proc.returncode, stderr) for proc, stderr in zip(procs, said, strict=True)]


@contextlib.contextmanager
def started_on_two_hosts(
    tmp_path: Path, repo_root: Path, copies: list[Path], *args: str
) -> Iterator[list[subprocess.Popen]]:
    """The 2 processes of `on_two_hosts`, with `args`, started (stderr a pipe) and killed at the
    end of the block."""
    cmd = [sys.executable, "-m", "trainer.main", "--config", str(repo_root / "configs/tiny.yaml")]
    cmd += ["data.path=data", f"run.workdir={tmp_path / 'run'}", *args]
    hosts = [tmp_path / f"host{index}" for index in range(2)]
    for host, copy in zip(hosts, copies, strict=True):
        host.mkdir()
        (host / "data").symlink_to(copy)
    with reserved_port() as port:
        env = cpu_env(
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            PYTHONPATH=str(repo_root),
        )
        procs = [
            subprocess.Popen(
                cmd,
                cwd=host,
                env={**env, "JAX_PROCESS_ID": str(index)},
                stdout=subprocess.DEVNULL,  # Gloo's lines
                stderr=subprocess.PIPE,
                text=True,
            )
            for index, host in enumerate(hosts)
        ]
        try:
            yield procs
        finally:
            for proc in procs:
                proc.kill()


def test_processes_reading_different_copies_of_the_dataset_are_told_so(tmp_path, corpus, repo_root):
    """One host's copy of the dataset holds another one (stale, or prepared with other
    settings): both processes trained on, silently, each on its own data. Both now stop at
    start-up with one line naming the two."""
    other = prepare_dataset(documents(), tmp_path / "other", eval_fraction=0.2, progress=False)
    prints = [load_dataset_info(path).fingerprint for path in (corpus, other)]
    for status, stderr in on_two_hosts(tmp_path, repo_root, [corpus, other]):
        assert status == 2, stderr[-3000:]
        assert stderr.splitlines()[1:] == [
            f"error: process 1 reads other data than process 0 at data.path=data (dataset "
            f"fingerprint {prints[1]}; process 0's {prints[0]}); give every host the same "
            "prepared dataset: copy it to each host again, or point data.path at storage every "
            "host mounts (NFS, Lustre, ...)"
        ], stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_copy_of_the_dataset_that_does_not_open_on_one_host_stops_every_process(
    tmp_path, corpus, damaged, repo_root
):
    """A half-copied dataset on one host: that process said why in one line, then waited for
    the others at exit (`JAX_SHUTDOWN_TIMEOUT_S`) while they waited for it in their first
    collective, until both aborted with C++ stack traces. Now every process stops at once
    (process 0 after its line saying what the shard check reads: process 1's copy alone, since
    process 0 reads the shards as prepare left them)."""
    copy, shard = damaged
    (process_0, said_0), (process_1, said_1) = on_two_hosts(tmp_path, repo_root, [corpus, copy])
    assert (process_0, process_1) == (2, 2), said_0[-3000:] + said_1[-3000:]
    shards = [path for path, _ in load_dataset_info(corpus).checksums()]
    size = sum(path.stat().st_size for path in shards)
    assert said_0.splitlines()[1:] == [
        f"checking the sha256 of {len(shards)} shards ({size / 1e6:.1f} MB) before training, "
        "all by process 1 of 2; a one-time check: later starts skip the shards that pass it and "
        "are unchanged since (data.verify_checksums=false turns it off)",
        "error: process 1 could not open its data at data.path=data (its own log says why); "
        "repair that host's copy, or point data.path at storage every host mounts (NFS, "
        "Lustre, ...)",
    ], said_0[-3000:]
    assert said_1.splitlines()[1:] == [
        f"error: shard data/{shard.name} does not match the checksum in data/dataset.json "
        "(changed or damaged since prepare); restore it or re-run python -m "
        "input_pipeline.prepare --overwrite (data.verify_checksums=false skips this)"
    ], said_1[-3000:]


AGREE_ON_DATA = """
import os
import sys
from trainer.errors import ConfigError
from trainer.parallel.agreement import check_same_data
from trainer.parallel.distributed import cluster_from_env, initialize

said = open(sys.argv[1], "w", buffering=1)  # stdout also carries Gloo's lines
initialize(cluster_from_env())
me = int(os.environ["JAX_PROCESS_ID"])
check_same_data("a3fb9c61e7a204d6", "data.path", "data/web")
print("the same dataset passes", file=said)
check_same_data(None, "data.path", "data/web")
print("each host's own batches pass", file=said)
for mine in (["a3fb9c61e7a204d6", "1cbb79856a1fe4d5"], [None, "1cbb79856a1fe4d5"]):
    try:
        check_same_data(mine[me], "data.mixture", "data/web, data/code")
    except ConfigError as err:
        print(f"error: {err}", file=said)
"""


def test_a_callers_own_batches_are_not_compared_across_processes(tmp_path, repo_root):
    """`trainer.run(config, data=...)` feeds each host's own rows, whose fingerprint names only
    their type: they pass on every process, while a prepared dataset on some processes and a
    caller's batches on others is refused like two datasets. Alone it is a no-op."""
    assert check_same_data("a3fb9c61e7a204d6", "data.path", "data/web") is None
    script, said = tmp_path / "agree.py", [tmp_path / f"said{i}.txt" for i in range(2)]
    script.write_text(AGREE_ON_DATA)
    statuses, printed = on_two_joined_processes(
        repo_root, [[str(script), str(said[i])] for i in range(2)], devices=1
    )
    assert statuses == [0, 0], printed
    fix = (
        "give every host the same prepared dataset: copy it to each host again, or point "
        "data.mixture at storage every host mounts (NFS, Lustre, ...)"
    )
    assert [path.read_text().splitlines() for path in said] == [
        [
            "the same dataset passes",
            "each host's own batches pass",
            "error: process 1 reads other data than process 0 at data.mixture=data/web, "
            "data/code (dataset fingerprint 1cbb79856a1fe4d5; process 0's a3fb9c61e7a204d6); "
            + fix,
            "error: process 1 reads other data than process 0 at data.mixture=data/web, "
            "data/code (dataset fingerprint 1cbb79856a1fe4d5; process 0's none (batches passed "
            "to trainer.run)); " + fix,
        ]
    ] * 2, printed


def test_a_process_that_stops_on_its_own_error_ends_at_once(tmp_path, corpus, repo_root):
    """One host's copy of the eval split is damaged past its checksum check (data.verify_
    checksums=false): that process's first eval read, after step 2, is one line, exit 2. It then
    waited at exit for the other, which waited for it in the eval's collective (neither had
    ended after 300 s). Now it ends at once, so the other's collective fails
    without it (JAX: another task died, within the heartbeat timeout:
    `test_killed_process_stops_its_peer_and_the_rerun_resumes`) and the first error stands alone
    in its log."""
    copy, shard = flipped_copy(corpus, tmp_path / "damaged", "eval-*")
    args = ["run.steps=4", "data.verify_checksums=false", "eval.every=2", "checkpoint.every=100"]
    with started_on_two_hosts(tmp_path, repo_root, [corpus, copy], *args) as procs:
        said_1 = procs[1].communicate(timeout=300)[1]
    assert procs[1].returncode == 2, said_1[-3000:]
    error = said_1.splitlines()[-1]
    assert error.startswith(f"error: shard data/{shard.name} is corrupt or truncated ("), error
