"""launch/local.sh's own choice of a coordinator port: held from the choice until the launcher
ends, so that nothing else takes it before process 0's coordinator (JAX's runtime) listens.

`cpu_env` and `launched_pids` are test_multihost.py's, imported from it.
"""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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
print(f"process {os.environ['JAX_PROCESS_ID']} joined", flush=True)
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
    assert sorted(done.stdout.split("\n")[:-1]) == ["process 0 joined", "process 1 joined"]


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
