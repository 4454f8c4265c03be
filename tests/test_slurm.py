"""`sbatch launch/slurm.sbatch` on a real one-node Slurm cluster on loopback, started here.

Debian's slurm-wlm daemons run by hand (no systemd) from a scratch folder with their own ports
and `auth/none`, so nothing outside this test's folder is touched. Where Slurm is not installed
or cannot start, the test is skipped with the reason (CI installs it: see .ci/run).
"""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import compile_cache
from test_multihost import (
    RTOL,
    STEPS,
    cpu_env,
    eval_losses_of,
    free_port,
    losses_of,
    run_args,
    single_process_baseline,
)

DAEMONS = ("slurmctld", "slurmd")


def slurm_conf(folder: Path) -> str:
    user = "root" if os.geteuid() == 0 else os.environ.get("USER", "nobody")
    return f"""\
ClusterName=pytest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs={max(2, os.cpu_count() or 2)} RealMemory=1000
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def node_state(env: dict[str, str]) -> str:
    done = subprocess.run(
        ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30
    )
    return done.stdout.strip() or done.stderr.strip()


def stop(folder: Path, env: dict[str, str]) -> None:
    """Cancel what is left of our jobs, then stop the daemons we started, by their pid files."""
    subprocess.run(["scancel", "--full", "--partition=debug"], env=env, capture_output=True)
    for daemon in reversed(DAEMONS):
        pid_file = folder / f"{daemon}.pid"
        if not pid_file.exists():
            continue
        pid = int(pid_file.read_text())
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)


def alive(pid: int) -> bool:
    """Running, and not a zombie (a daemon's parent may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Environment for Slurm's clients (SLURM_CONF) of a fresh one-node cluster."""
    missing = [t for t in (*DAEMONS, "sbatch", "sinfo", "scancel") if shutil.which(t) is None]
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} not found); "
            "apt-get install slurmctld slurmd slurm-client to run this test"
        )
    if os.geteuid() != 0:
        pytest.skip("starting slurmd needs root; run as root (as CI does) to test Slurm")
    folder = tmp_path_factory.mktemp("slurm")
    (folder / "state").mkdir()
    (folder / "spool").mkdir()
    conf = folder / "slurm.conf"
    conf.write_text(slurm_conf(folder))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started = [
        subprocess.run([shutil.which("slurmctld"), "-f", str(conf)], env=env, capture_output=True),
        subprocess.run(
            [shutil.which("slurmd"), "-f", str(conf), "-N", "localhost"],
            env=env,
            capture_output=True,
        ),
    ]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and node_state(env) != "idle":
        time.sleep(0.3)
    if node_state(env) != "idle":
        logs = " | ".join(p.read_text()[-300:] for p in sorted(folder.glob("*.log")))
        errors = " | ".join(s.stderr.decode()[-300:] for s in started if s.returncode)
        stop(folder, env)
        pytest.skip(f"Slurm could not start (node {node_state(env)!r}): {errors} {logs}")
    yield {"env": env, "folder": folder}
    stop(folder, env)


@pytest.mark.slow
def test_sbatch_two_tasks_on_cpu_match_one_process(
    slurm, tmp_path_factory, tmp_path, repo_root, corpus
):
    baseline = single_process_baseline(tmp_path_factory, repo_root, corpus)
    workdir = tmp_path / "slurm-run"
    env = cpu_env(
        **compile_cache(tmp_path_factory),
        SLURM_CONF=slurm["env"]["SLURM_CONF"],
        CONFIG="configs/tiny.yaml",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",  # 2 tasks x 4 devices
        JAX_COORDINATOR_PORT=str(free_port()),  # not the job-id port another cluster may use
    )
    output = slurm["folder"] / "job-%j.out"
    cmd = [
        "sbatch",
        "--wait",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        f"--output={output}",
        f"--chdir={repo_root}",
        "launch/slurm.sbatch",
        *run_args(corpus, workdir),
    ]
    done = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=400)
    job_logs = "".join(p.read_text()[-3000:] for p in slurm["folder"].glob("job-*.out"))
    assert done.returncode == 0, f"{done.stdout}{done.stderr}{job_logs}"
    assert "joining the slurm-detected cluster" in job_logs  # JAX read SLURM_* itself
    got, want = losses_of(workdir), losses_of(baseline)
    assert sorted(got) == list(range(1, STEPS + 1))
    steps = sorted(want)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=RTOL)
    np.testing.assert_allclose(
        eval_losses_of(workdir)[STEPS], eval_losses_of(baseline)[STEPS], RTOL
    )
