"""`sbatch launch/slurm.sbatch` on a real one-node Slurm cluster on loopback, started here.

Debian's slurm-wlm daemons run by hand (no systemd) from a scratch folder with their own ports
and `auth/none`, so nothing outside this test's folder is touched. Where Slurm is not installed
or cannot start, the test is skipped with the reason (CI installs it: see .ci/run).

The job requeues itself: the time-limit warning is delivered as `--signal=B:USR1@N` sends it
(`scancel --signal=USR1 --batch`), and a stuck task's exit 3 comes from a stand-in interpreter
(the sbatch's PYTHON knob). Slurm holds a requeued job for its launch credential's lifetime
(`AuthInfo=cred_expire`, 120 s by default): this cluster's is 5 s. Releasing the job sooner by
hand (`scontrol update StartTime=now`) loses it now and then: "Killing non-startable batch
JobId=1: Job credential revoked", and the job ends FAILED. Once the hold is over, the job waits
for a scheduling pass, which no event triggers: here the main scheduling loop runs every second
(`sched_interval=1`; by default every 60 s, and the backfill pass every 30 s, which skips itself
when nothing changed since it last ran), so a requeued job starts within a second of its hold.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
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
    metrics_of,
    reserved_port,
    run_args,
    single_process_baseline,
)

from trainer.preemption import Stopped

DAEMONS = ("slurmctld", "slurmd")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


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
AuthInfo=cred_expire=5
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
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
    return process_state(pid) not in ("", "Z")


def process_state(pid: int) -> str:
    """The process's state letter in /proc (R running, S waiting, Z zombie...); "" once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return ""


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


def submit(env: dict[str, str], repo_root: Path, output: Path, *args: str) -> str:
    """`sbatch launch/slurm.sbatch` as two tasks on the one CPU node; the job id."""
    cmd = [
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        f"--output={output}",
        f"--chdir={repo_root}",
        "launch/slurm.sbatch",
        *args,
    ]
    done = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_fields(env: dict[str, str], job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields (JobState, Reason, Restarts, ExitCode, Comment...)."""
    done = subprocess.run(
        ["scontrol", "--oneliner", "show", "job", job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return dict(field.split("=", 1) for field in done.stdout.split() if "=" in field)


def wait_for_job(env: dict[str, str], job_id: str, log: Path, timeout: float) -> dict[str, str]:
    """The job's fields once it has ended (after every session, when it requeues itself)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = job_fields(env, job_id)
        if job.get("JobState") in ENDED:
            return job
        time.sleep(0.3)
    pytest.fail(f"job {job_id} did not end within {timeout} s: {job}\n{tail(log)}")


def wait_for_line(env: dict[str, str], job_id: str, log: Path, line: str, timeout: float) -> None:
    """Until the job's output holds `line`; a job that ends first fails the test with its log."""
    deadline = time.monotonic() + timeout
    while line not in tail(log, 100_000):
        job = job_fields(env, job_id)
        if job.get("JobState") in ENDED or time.monotonic() > deadline:
            pytest.fail(f"job {job_id} never printed {line!r}: {job}\n{tail(log)}")
        time.sleep(0.2)


def tail(log: Path, chars: int = 4000) -> str:
    """The end of a job's output (for failure messages), or why there is none yet."""
    return log.read_text()[-chars:] if log.exists() else f"({log} not written)"


@pytest.mark.slow
def test_sbatch_two_tasks_match_one_process_and_requeue_themselves_before_the_time_limit(
    slurm, tmp_path_factory, tmp_path, repo_root, corpus
):
    """Two tasks train the one-process run's batches. The time-limit warning comes while they
    compile their first step: both save after the same step and exit 0, the job requeues itself
    (the same job id, one output file), and its next session resumes from that checkpoint and
    ends on the straight run's losses."""
    baseline = single_process_baseline(tmp_path_factory, repo_root, corpus)
    workdir = tmp_path / "slurm-run"
    with reserved_port() as port:  # held until process 0's coordinator listens there
        env = cpu_env(
            **compile_cache(tmp_path_factory),
            SLURM_CONF=slurm["env"]["SLURM_CONF"],
            CONFIG="configs/tiny.yaml",
            XLA_FLAGS="--xla_force_host_platform_device_count=4",  # 2 tasks x 4 devices
            JAX_COORDINATOR_PORT=str(port),  # not the job-id port another cluster may use
        )
        job_id = submit(env, repo_root, slurm["folder"] / "job-%j.out", *run_args(corpus, workdir))
        log = slurm["folder"] / f"job-{job_id}.out"
        # Process 0's start-up line comes after every process joined the runtime (whose preemption
        # service takes SIGTERM from there on) and before the first step compiles (seconds here).
        # Later steps take ~0.1 s: a warning then would come after the last one.
        wait_for_line(env, job_id, log, "\ntiny: model", timeout=300)
        warning = ["scancel", "--signal=USR1", "--batch", job_id]  # what --signal=B:USR1@N sends
        subprocess.run(warning, env=env, check=True, capture_output=True, timeout=30)
        job = wait_for_job(env, job_id, log, timeout=400)

    job_log = log.read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        f"{job}\n{job_log[-3000:]}"
    )
    assert "joining the slurm-detected cluster" in job_log  # JAX read SLURM_* itself
    stopped = int(re.search(r"stopped by SIGTERM at step (\d+)", job_log)[1])
    assert 1 <= stopped < STEPS, job_log[-3000:]
    assert job_log.count(f"finished at step {stopped} of {STEPS}: stopped early") == 2
    assert job_log.count(f"requeueing job {job_id} to resume from the latest checkpoint") == 1
    sessions = [f"job {job_id} (session 1)", f"job {job_id} (session 2)"]
    assert all(session in job_log for session in sessions), "the output file kept both sessions"
    assert f"resuming from {workdir}/checkpoints/{stopped} (step {stopped})" in job_log
    assert [r["step"] for r in metrics_of(workdir) if "loss" in r] == list(range(1, STEPS + 1))
    got, want = losses_of(workdir), losses_of(baseline)
    assert sorted(got) == list(range(1, STEPS + 1))
    steps = sorted(want)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=RTOL)
    np.testing.assert_allclose(
        eval_losses_of(workdir)[STEPS], eval_losses_of(baseline)[STEPS], RTOL
    )


STAND_IN = """#!/bin/sh
# python -m trainer.main ... as seen from Slurm: task 0 fails with $FAIL_STATUS, task 1 waits
# for the step to be ended (it dies of Slurm's SIGTERM: srun's own status becomes 143).
echo "stand-in task $SLURM_PROCID, session ${SLURM_RESTART_COUNT:-0}" >&2
if [ "$SLURM_PROCID" = 0 ]; then
  sleep 1
  echo "error: watchdog (process 0 of 2): no progress (stand-in)" >&2
  exit "$FAIL_STATUS"
fi
exec sleep 120
"""


@pytest.mark.parametrize(
    ("status", "restarts", "last_line"),
    [
        (3, "1", "a task was stuck (exit 3) after 1 requeue(s) in a row (STUCK_REQUEUES=1); not"),
        (2, "0", "the training step failed with status 2 (2: a user error; 1: a crash; see"),
    ],
)
def test_a_stuck_task_is_requeued_a_bounded_number_of_times_and_a_user_error_never(
    slurm, tmp_path, repo_root, status, restarts, last_line
):
    """A task that exits 3 (the watchdog: stuck) requeues the job, here at most once
    (STUCK_REQUEUES=1), and stuck again it ends with status 3; a user error (2) ends it at
    once. The status is the failed task's, not srun's (143, from the peer it ended)."""
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    env = {
        **slurm["env"],
        "PYTHON": str(stand_in),
        "FAIL_STATUS": str(status),
        "STUCK_REQUEUES": "1",
    }
    job_id = submit(env, repo_root, tmp_path / "job-%j.out", "run.steps=1")
    log = tmp_path / f"job-{job_id}.out"
    job = wait_for_job(env, job_id, log, timeout=120)

    job_log = log.read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == (
        "FAILED",
        f"{status}:0",
        restarts,
    ), f"{job}\n{job_log}"
    lines = [x for x in job_log.splitlines() if x.startswith("slurm.sbatch: ")]
    assert len(lines) == 1 + 2 * int(restarts) + 1, job_log  # start, (requeue, start), end
    assert lines[-1].startswith(f"slurm.sbatch: {last_line}"), job_log
    if restarts == "1":
        assert lines[1].startswith(
            "slurm.sbatch: a task was stuck (exit 3, its stacks above): requeueing job "
            f"{job_id} to resume from the latest checkpoint (stuck requeue 1 of "
            "STUCK_REQUEUES=1 in a row)"
        ), job_log
        assert "stuck_requeues=1" in job.get("Comment", ""), job


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"STUCK_REQUEUES": "three"}, "STUCK_REQUEUES=three is not a whole number >= 0; give it"),
        ({"PYTHON": "no-such-python"}, "PYTHON=no-such-python is not a command here; set PYTHON"),
        ({"STARTUP_REQUEUES": "-1"}, "STARTUP_REQUEUES=-1 is not a whole number >= 0; give"),
    ],
)
def test_bad_knobs_of_the_slurm_script_are_one_line(repo_root, knobs, message):
    env = {**os.environ, "SLURM_JOB_ID": "1", "PYTHON": sys.executable, **knobs}
    done = subprocess.run(
        ["bash", "launch/slurm.sbatch"], cwd=repo_root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"slurm.sbatch: {message}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


KILLED_STAND_IN = """#!/bin/sh
# python -m trainer.main ... still importing when the warning comes: its default SIGTERM action
# ends it (srun: "tasks 0-1: Terminated"). Each session says it is starting.
echo "stand-in task $SLURM_PROCID starting, session ${SLURM_RESTART_COUNT:-0}" >&2
exec sleep 120
"""

# ... or joining JAX's runtime: the trainer's own start-up line (the file `line` beside it), exit
# 0. Its handler is set before it says it is starting, when the test's warning may come. Slurm
# signals every process of the step, deepest first (proctrack/linuxproc), so the stand-in starts
# none: the handler writes the line with builtins only, and it waits in a builtin, `read` from a
# FIFO that nobody writes. It waited for a `sleep`: one that died of the SIGTERM before the shell
# got its own let the shell reach its end and exit 0 without the line (the session looked like a
# save, and was requeued uncounted); one forked just as the handler ran outlived it, holding the
# task's output (slurmstepd waits 60 s for it).
ANSWERING_STAND_IN = """#!/bin/sh
read -r line < "${0%/*}/line"
nobody_writes="${0%/*}/fifo.$$"
mkfifo "$nobody_writes"
trap 'echo "$line" >&2; exit 0' TERM
echo "stand-in task $SLURM_PROCID starting, session ${SLURM_RESTART_COUNT:-0}" >&2
read -r _ <> "$nobody_writes"
"""


@pytest.mark.parametrize("stand_in_text", [KILLED_STAND_IN, ANSWERING_STAND_IN])
def test_a_warning_during_the_tasks_start_up_requeues_the_job_a_bounded_number_of_times(
    slurm, tmp_path, repo_root, stand_in_text
):
    """The time-limit warning that comes before the tasks joined JAX's runtime ends them at once
    (nothing trained, nothing lost): the job requeues itself, as after a save, but at most
    STARTUP_REQUEUES times in a row (a --time shorter than the start-up would loop forever).
    Before, a trainer that said so and exited 0 was taken for one that saved: requeued forever."""
    stand_in = tmp_path / "python"
    stand_in.write_text(stand_in_text)
    stand_in.chmod(0o755)
    joining = "the cluster at 127.0.0.1:1234 as process 0 of 2"
    (tmp_path / "line").write_text(Stopped("SIGTERM", False, joining=joining).line() + "\n")
    env = {**slurm["env"], "PYTHON": str(stand_in), "STARTUP_REQUEUES": "1"}
    job_id = submit(env, repo_root, tmp_path / "job-%j.out", "run.steps=1")
    log = tmp_path / f"job-{job_id}.out"
    warning = ["scancel", "--signal=USR1", "--batch", job_id]  # what --signal=B:USR1@N sends
    for session in (0, 1):
        wait_for_line(env, job_id, log, f"starting, session {session}", timeout=120)
        subprocess.run(warning, env=env, check=True, capture_output=True, timeout=30)
    job = wait_for_job(env, job_id, log, timeout=120)

    job_log = log.read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "143:0", "1"), (
        f"{job}\n{job_log}"
    )
    lines = [x for x in job_log.splitlines() if x.startswith("slurm.sbatch: ")]
    assert lines[2].startswith(
        "slurm.sbatch: time limit near: the tasks were still starting, and ended on the SIGTERM "
        f"before their first step (nothing trained, nothing lost); requeueing job {job_id} to "
        "resume from the latest checkpoint (start-up requeue 1 of STARTUP_REQUEUES=1 in a row)"
    ), job_log
    assert lines[-1].startswith(
        "slurm.sbatch: time limit near: the tasks were still starting, and ended on the SIGTERM "
        "before their first step, after 1 such requeue(s) in a row (STARTUP_REQUEUES=1); not "
        "requeueing: --time leaves no time"
    ), job_log
    assert len(lines) == 6, job_log  # start, warned, requeue; start, warned, stop
    assert "startup_requeues=1" in job.get("Comment", ""), job


def children(pid: int) -> set[int]:
    """The processes that `pid` started and has not yet reaped (Linux's /proc)."""
    try:
        return {int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except FileNotFoundError:  # the process has ended
        return set()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_the_answering_stand_in_waits_for_slurms_sigterm_with_no_child_process(tmp_path):
    """Slurm's SIGTERM reaches every process of the step, deepest first. The stand-in waited on a
    `sleep`: when the `sleep` died first, the stand-in ended with it, exit 0 without its line (the
    session looked like a save, the job ran a third one, and the test above timed out); a `sleep`
    forked just as the handler ran outlived it, holding the task's output. Waiting, it must have
    no child, and answer the SIGTERM with its line and exit 0, its output closed."""
    stand_in = tmp_path / "python"
    stand_in.write_text(ANSWERING_STAND_IN)
    stand_in.chmod(0o755)
    line = Stopped("SIGTERM", False, joining="the cluster at 127.0.0.1:1234").line()
    (tmp_path / "line").write_text(line + "\n")
    env = {**os.environ, "SLURM_PROCID": "0"}
    task = subprocess.Popen([str(stand_in)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert "starting" in task.stderr.readline()
        deadline = time.monotonic() + 30
        while process_state(task.pid) != "S":  # until it waits
            assert time.monotonic() < deadline, "the stand-in never waited"
            time.sleep(0.05)
        assert not children(task.pid), "a child that Slurm's SIGTERM would reach first"
        task.send_signal(signal.SIGTERM)
        _, stderr = task.communicate(timeout=30)  # every holder of its stderr has closed it
    finally:
        if task.poll() is None:  # a failure above: end the stand-in and its children
            for pid in children(task.pid):
                os.kill(pid, signal.SIGKILL)
            task.kill()
            task.wait()
    assert (task.returncode, stderr) == (0, line + "\n")


# ----------------------------------------------------------------------------- signals early on
# The script under plain bash, with stand-ins for Slurm's commands (no cluster needed): a signal
# is sent at a chosen point of its start-up, which a real Slurm cannot time.

FAKE_SRUN = """#!/bin/sh
# srun whose tasks are still starting: the step's SIGTERM ends them ("Terminated", no status).
echo $$ > "$FAKE/srun.pid"
sleep 120 &
trap 'kill $!; echo "srun: error: localhost: tasks 0-1: Terminated" >&2; exit 143' TERM
wait
"""

FAKE_SLURM = {
    "srun": FAKE_SRUN,
    # the step once srun runs (squeue --steps), and an empty Comment (--format=%k)
    "squeue": """#!/bin/sh
case "$*" in
  *--steps*) [ -s "$FAKE/srun.pid" ] && echo "$SLURM_JOB_ID.0" ;;
  *) echo "(null)" ;;
esac
exit 0
""",
    "scancel": """#!/bin/sh
echo "scancel $*" >> "$FAKE/calls"
kill -TERM "$(cat "$FAKE/srun.pid")"
""",
    "scontrol": """#!/bin/sh
echo "scontrol $*" >> "$FAKE/calls"
""",
}

# BASH_ENV, read by the script's bash before the script: SIGNAL to the shell itself, once, just
# before the first command that starts with BEFORE.
SIGNAL_BEFORE = """\
trap '[[ $BASH_COMMAND == "$SIGNAL_BEFORE"* ]] && {{ trap - DEBUG; kill -{signal} $$; }}' DEBUG
"""


def fake_slurm(folder: Path, **extra: str) -> dict[str, str]:
    """An environment whose PATH finds stand-ins for srun, squeue, scancel and scontrol (and
    `extra` commands) in `folder`; they note their calls in `folder`/calls."""
    for name, text in {**FAKE_SLURM, **extra}.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    (folder / "tmp").mkdir()
    return {
        **env,
        "PATH": f"{folder}{os.pathsep}{env['PATH']}",
        "FAKE": str(folder),
        "TMPDIR": str(folder / "tmp"),
        "SLURM_JOB_ID": "123",
        "PYTHON": sys.executable,
    }


def signalled_early(folder: Path, signal_name: str, before: str) -> dict[str, str]:
    """BASH_ENV for `fake_slurm`'s environment: SIGUSR1/SIGTERM to the script's shell just before
    its first command starting with `before`."""
    hook = folder / f"signal-{signal_name}"
    hook.write_text(SIGNAL_BEFORE.format(signal=signal_name))
    return {"BASH_ENV": str(hook), "SIGNAL_BEFORE": before}


def script_in_fake_slurm(repo_root, env: dict[str, str]) -> subprocess.CompletedProcess:
    """launch/slurm.sbatch run by bash alone, with `fake_slurm`'s commands (`env`)."""
    return subprocess.run(
        ["bash", "launch/slurm.sbatch", "run.steps=1"],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_warning_while_the_script_checks_its_knobs_stops_the_step_once_it_starts(
    repo_root, tmp_path
):
    """`--signal=B:USR1@S` warns at the job's start when --time is shorter than S (plus Slurm's
    up to 60 s): a SIGUSR1 before the script's trap ended the batch shell (bash's default action,
    exit 138) and the job with it, not requeued. Its trap was set after the knob checks; a warning
    during them (here: while it checks PYTHON) now stops the step as soon as it starts, and the
    job requeues itself as for any warning during the tasks' start-up."""
    env = fake_slurm(tmp_path)
    env.update(signalled_early(tmp_path, "USR1", before="command -v "))
    done = script_in_fake_slurm(repo_root, env)
    assert done.returncode == 0, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.startswith("slurm.sbatch: ")]
    assert lines[0].startswith("slurm.sbatch: time limit near (SIGUSR1): asking every task"), lines
    assert lines[-1].startswith(
        "slurm.sbatch: time limit near: the tasks were still starting, and ended on the SIGTERM "
        "before their first step (nothing trained, nothing lost); requeueing job 123 to resume "
        "from the latest checkpoint (start-up requeue 1 of STARTUP_REQUEUES=3 in a row)"
    ), done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == "scancel --signal=TERM 123.0", calls
    assert calls[-1] == "scontrol requeue 123", calls
    assert not list((tmp_path / "tmp").iterdir()), "srun's stderr copy was removed"


def test_a_sigterm_right_after_the_scripts_temporary_file_is_made_removes_it(repo_root, tmp_path):
    """scancel (or the time limit) sends SIGTERM to the batch shell: its exit trap removes the
    copy of srun's stderr. A SIGTERM between mktemp and that trap left the file behind."""
    mktemp = shutil.which("mktemp")
    fake_mktemp = f'#!/bin/sh\n{mktemp} "$@"\nkill -TERM $PPID\n'  # made, then the SIGTERM
    env = fake_slurm(tmp_path, mktemp=fake_mktemp)
    done = script_in_fake_slurm(repo_root, env)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert not (tmp_path / "srun.pid").exists(), "srun never started"
    assert not list((tmp_path / "tmp").iterdir()), done.stderr
