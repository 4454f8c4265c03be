"""launch/local.sh's own choice of a coordinator port: held from the choice until the launcher
ends, so that nothing else takes it before process 0's coordinator (JAX's runtime) listens.

`cpu_env` and `launched_pids` are test_multihost.py's, imported from it.
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_multihost import cpu_env, launched_pids

# Another program that listens on the port local.sh chose for process 0, before process 0's
# coordinator does: a plain bind on each address that the coordinator's bind on every interface
# ([::], IPv4 and IPv6) collides with. It says which it took, then keeps them until killed.
COMPETITOR = """\
import socket, sys, time
port = int(sys.argv[1])
taken = []
for family, host in [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1"),
                     (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")]:
    try:
        listener = socket.socket(family)
        listener.bind((host, port))
        listener.listen()
    except OSError:  # in use (or no IPv6 here)
        continue
    taken.append(listener)
print(" ".join(f"[{s.getsockname()[0]}]" for s in taken) or "nothing", flush=True)
sys.stdout.close()
time.sleep(300)
"""

# PYTHON for local.sh: its port holder runs as is; each process joins JAX's runtime and says so
# (what needs the port: no training), and process 0 first lets the competitor take what it can of
# its coordinator's port (the seconds between local.sh's choice and the coordinator's bind, made
# certain).
COMPETING_PYTHON = """\
#!/bin/sh
[ "$1" = -c ] && exec {python} "$@"
if [ "${{JAX_PROCESS_ID:-}}" = 0 ]; then
  {python} {competitor} "${{JAX_COORDINATOR_ADDRESS##*:}}" > {taken} 2>&1 < /dev/null &
  echo $! > {competitor_pid}
  while [ ! -s {taken} ]; do sleep 0.05; done
fi
exec {python} {join}
"""

JOIN = """\
import os
from trainer.parallel.distributed import cluster_from_env, initialize

initialize(cluster_from_env())
# One write of the whole line: under xdist (PYTHONUNBUFFERED=1, inherited) print wrote the text
# and its newline apart, and the two processes' lines interleaved in the launcher's stdout.
os.write(1, f"process {os.environ['JAX_PROCESS_ID']} joined\\n".encode())
"""


def stand_in(folder: Path, text: str) -> Path:
    """An executable `python` in `folder` with `text` (local.sh's PYTHON knob)."""
    python = folder / "python"
    python.write_text(text)
    python.chmod(0o755)
    return python


@contextlib.contextmanager
def killed_at_the_end(pid_file: Path):
    """SIGKILL to the process whose pid is in `pid_file` (if it was written) once done."""
    try:
        yield
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def coordinator_port_of(stderr: str) -> int:
    """The port local.sh announced for process 0's coordinator."""
    return int(re.search(r"coordinator 127\.0\.0\.1:(\d+)", stderr)[1])


def free_again(port: int, timeout: float) -> bool:
    """Whether a plain bind on `port` (every interface) succeeds within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
        time.sleep(0.1)


def test_nothing_takes_the_port_local_sh_chose_before_process_0_listens(tmp_path, repo_root):
    """local.sh found a free port and let it go, and process 0's coordinator bound it seconds
    later: anything that listened there first (say, another test's run starting at the same
    time) ended the run on process 0's "port P ... is already in use" line, exit 2. The port now
    stays bound (never listening) until the launcher ends: nothing else can listen on it, on any
    address, and the coordinator still can. (A holder on 127.0.0.1 only left [::1]:P open.)"""
    competitor, taken, pid_file = tmp_path / "take.py", tmp_path / "taken", tmp_path / "pid"
    competitor.write_text(COMPETITOR)
    join = tmp_path / "join.py"
    join.write_text(JOIN)
    python = stand_in(
        tmp_path,
        COMPETING_PYTHON.format(
            python=sys.executable,
            competitor=competitor,
            taken=taken,
            competitor_pid=pid_file,
            join=join,
        ),
    )
    env = cpu_env(PYTHON=str(python), LOCAL_DEVICE="cpu", PYTHONPATH=str(repo_root))
    with killed_at_the_end(pid_file):
        done = subprocess.run(
            [str(repo_root / "launch/local.sh"), "2"],
            cwd=repo_root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert taken.read_text().split() == ["nothing"], done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.split("\n")[:-1]) == ["process 0 joined", "process 1 joined"], repr(
        done.stdout
    )


# Runs the command in argv with SIGINT's default action, as a terminal's job has it (a test
# worker may ignore SIGINT, which its children inherit); not a `preexec_fn`, which makes
# subprocess fork the test's multithreaded process (JAX warns: it may deadlock).
WITH_CTRL_C = """\
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_ctrl_c_ends_the_launcher_with_its_processes_and_the_port_holder_quietly(
    tmp_path, repo_root
):
    """Ctrl-C reaches every process of the terminal's foreground group. Both processes ending on
    it at once, the launcher's `wait -n` missed one of them and waited until LOCAL_KILL_GRACE_S
    was up (seen with 3 s: 10 of 12 runs took the 3 s, 2 never ended), and for ever once the
    port holder also kept it company (10 of 10). The port holder ignores Ctrl-C (a
    KeyboardInterrupt there printed a traceback) and ends with the launcher, freeing the port."""
    python = stand_in(
        tmp_path, f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\nexec sleep 600\n'
    )
    env = cpu_env(PYTHON=str(python), LOCAL_DEVICE="cpu", LOCAL_KILL_GRACE_S="600")
    log = tmp_path / "local.log"
    with log.open("w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-c", WITH_CTRL_C, str(repo_root / "launch/local.sh"), "2"],
            env=env,
            stderr=stderr,
            start_new_session=True,  # its own group, as a terminal's foreground job has
        )
    try:
        deadline = time.monotonic() + 60
        while not both_sleeping(launched_pids(log)):
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C does
        launcher.wait(timeout=120)  # (not the 600 s grace)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    said = log.read_text()
    assert launcher.returncode == 130, said
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said
    assert free_again(coordinator_port_of(said), timeout=30), said


def both_sleeping(pids: list[int]) -> bool:
    """Whether the two processes have both become the stand-in's `sleep` (and end together)."""
    try:
        return len(pids) == 2 and all(
            Path(f"/proc/{pid}/comm").read_text().strip() == "sleep" for pid in pids
        )
    except FileNotFoundError:
        return False


def test_a_python_that_cannot_hold_a_port_is_one_line(tmp_path, repo_root):
    python = stand_in(tmp_path, f'#!/bin/sh\n[ "$1" = -c ] && exit 1\ntouch {tmp_path}/ran\n')
    env = cpu_env(PYTHON=str(python), LOCAL_DEVICE="cpu")
    done = subprocess.run(
        [str(repo_root / "launch/local.sh"), "2"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"local.sh: PYTHON={python} could not hold a free port for the coordinator; set "
        "JAX_COORDINATOR_PORT to a free port"
    ]
    assert not (tmp_path / "ran").exists(), "no training process starts"


MARK = "LOCAL_SH_TEST_MARK"


@pytest.fixture
def mark() -> str:
    """A value of `MARK` unique to this test: every process started with it in its environment
    (the launcher, and whatever it starts, however deep) carries it, and no other process does."""
    return f"{os.getpid()}-{time.monotonic_ns()}"


def processes_marked(mark: str) -> list[tuple[int, list[str]]]:
    """The pid and command line of each process whose environment has MARK=`mark` (of those
    /proc lets this user read)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if f"{MARK}={mark}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                argv = (proc / "cmdline").read_bytes().decode().split("\0")[:-1]
                found.append((int(proc.name), argv))
        except (OSError, ValueError):  # gone meanwhile, not ours to read, or not a process
            continue
    return found


def test_nothing_local_sh_started_outlives_it_when_one_process_fails(tmp_path, repo_root, mark):
    """Process 1 fails at once; local.sh stops process 0 (SIGTERM) and exits with its status.
    Its SIGKILL timer (a subshell running `sleep LOCAL_KILL_GRACE_S`) was ended at exit, but
    not its `sleep`, which stayed behind for the whole grace period, in the launcher's process
    group (a CI job or test harness waiting on that group waited for it). Every process local.sh
    started carries its environment: none may be left once it has exited."""
    python = stand_in(
        tmp_path,
        f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\n'
        '[ "$JAX_PROCESS_ID" = 1 ] && exit 3\nexec sleep 600\n',
    )
    env = cpu_env(PYTHON=str(python), LOCAL_DEVICE="cpu", LOCAL_KILL_GRACE_S="600")
    env[MARK] = mark
    try:
        done = subprocess.run(
            [str(repo_root / "launch/local.sh"), "2"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,  # (not the 600 s grace: process 0's `sleep` ends on SIGTERM)
        )
        assert done.returncode == 3, done.stderr
        assert "process " in done.stderr and "exited with status 3" in done.stderr, done.stderr
        assert processes_marked(mark) == [], done.stderr
    finally:
        for pid, _ in processes_marked(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# local.sh's wait loop, made to hold still: its `sleep 0.2` (found on PATH) waits on a FIFO while
# the file `hold` exists, and says so by creating `held`. Any other `sleep` runs as is.
HOLDING_SLEEP = """\
#!/bin/sh
if [ "$1" = 0.2 ] && [ -e {folder}/hold ]; then
  : > {folder}/held
  read _ < {folder}/release
fi
exec {sleep} "$@"
"""

# Runs in a new pid namespace (its own pid numbers, which it may choose), with local.sh in the
# background: process 1 exits 3 while the launcher's loop is held, and once its pid is free again
# another process of the same user is started with that very pid, then the loop goes on.
# Prints the launcher's status (or "still running" after 60 s) and whether the other process
# is alive, on one line.
REUSED_PID = """\
folder=$1 local_sh=$2
cd "$folder"
mkfifo release
: > hold
"$local_sh" 2 2> local.log &
launcher=$!
until grep -q ' processes (' local.log 2>/dev/null && [ -e held ]; do sleep 0.05; done
p1=$(sed -nE 's/.* processes \\([0-9]+ ([0-9]+)\\).*/\\1/p' local.log)
: > go
while [ -e /proc/$p1 ]; do sleep 0.05; done
echo $((p1 - 1)) > /proc/sys/kernel/ns_last_pid
sleep 600 &
other=$!
[ "$other" = "$p1" ] || { echo "the pid went to another process first"; exit 1; }
rm hold
echo > release
for _ in $(seq 600); do [ -e /proc/$launcher ] || break; sleep 0.1; done
if [ -e /proc/$launcher ]; then outcome="still running"; kill -KILL $launcher; else
  wait $launcher; outcome="exited $?"; fi
[ -e /proc/$other ] && alive=alive || alive=gone
kill -KILL $other 2>/dev/null
echo "launcher $outcome, other process $alive"
"""


def unshare_works() -> bool:
    """Whether this user may make a user + pid namespace (unshare(1), Linux)."""
    try:
        return subprocess.run(["unshare", "-Urpf", "--mount-proc", "true"]).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not unshare_works(), reason="needs unshare -Urpf (user + pid namespaces)")
def test_a_pid_given_to_another_process_does_not_hide_that_a_process_failed(tmp_path, repo_root):
    """Bash reaps a child as soon as it ends (keeping its status for `wait`), so its pid is free
    for the kernel to give out again. The wait loop asked `kill -0 PID` whether a process still
    ran: a process that took the pid of a failed one kept the launcher polling it, and the run's
    other processes running, for as long as it lived. Now the loop asks bash's job table (which
    a process of someone else's cannot enter), and signals only the processes still in it."""
    holding = tmp_path / "bin"
    holding.mkdir()
    sleep = holding / "sleep"
    sleep.write_text(HOLDING_SLEEP.format(folder=tmp_path, sleep=shutil.which("sleep")))
    sleep.chmod(0o755)
    python = stand_in(
        tmp_path,
        f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\n'
        f'[ "$JAX_PROCESS_ID" = 1 ] || exec sleep 600\n'
        f"while [ ! -e {tmp_path}/go ]; do sleep 0.05; done\nexit 3\n",
    )
    env = cpu_env(PYTHON=str(python), LOCAL_DEVICE="cpu", LOCAL_KILL_GRACE_S="600")
    env["PATH"] = f"{holding}{os.pathsep}{env['PATH']}"
    done = subprocess.run(
        ["unshare", "-Urpf", "--mount-proc", "bash", "-c", REUSED_PID, "reused-pid"]
        + [str(tmp_path), str(repo_root / "launch/local.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = f"{done.stdout}{done.stderr}\n{(tmp_path / 'local.log').read_text()}"
    assert done.stdout.strip() == "launcher exited 3, other process alive", said


def test_a_sigterm_to_the_launchers_group_during_the_grace_still_ends_in_sigkill(
    tmp_path, repo_root, mark
):
    """Process 1 fails; process 0 ignores SIGTERM, so local.sh's SIGKILL after the grace is what
    ends it. A SIGTERM to the launcher's whole group in that grace (a CI job cancelled, `timeout`
    on the group) ended the SIGKILL timer's subshell, and with it the SIGKILL: the launcher then
    waited for process 0 for ever. The timer ignores SIGTERM now."""
    python = stand_in(
        tmp_path,
        f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\n'
        "[ \"$JAX_PROCESS_ID\" = 1 ] && exit 3\ntrap '' TERM\nexec sleep 600\n",
    )
    env = cpu_env(PYTHON=str(python), LOCAL_DEVICE="cpu", LOCAL_KILL_GRACE_S="3", **{MARK: mark})
    log = tmp_path / "local.log"
    with log.open("w") as stderr:
        launcher = subprocess.Popen(
            [str(repo_root / "launch/local.sh"), "2"],
            env=env,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not grace_timer_started(mark, "3"):
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 3, log.read_text()


def grace_timer_started(mark: str, grace: str) -> bool:
    """Whether a `sleep GRACE` that the marked launcher started runs (local.sh's SIGKILL timer)."""
    return any(argv[:2] == ["sleep", grace] for _, argv in processes_marked(mark))
