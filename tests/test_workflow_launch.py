"""launch/local.sh as a user of four nodes meets it when one process dies (a node lost) or stops
on bad input: its lines name the process as the trainer's own lines do (process i, not only a
pid), say when a signal killed it, and end with what to do.

The processes are stand-ins for `python -m trainer.main` (what matters is how they end).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_multihost import cpu_env

# PYTHON for local.sh: the port holder runs as is; process 1 ends as the test says, the others
# wait to be stopped.
ENDING_PYTHON = """\
#!/bin/sh
[ "$1" = -c ] && exec {python} "$@"
[ "$JAX_PROCESS_ID" = 1 ] && {ending}
exec sleep 600
"""


@pytest.mark.parametrize(
    ("ending", "status", "how", "last"),
    [
        (
            "kill -KILL $$",
            137,
            "was killed by SIGKILL (status 137)",
            "re-run the same command to resume from the latest checkpoint (status 137)",
        ),
        (
            "exit 2",
            2,
            "exited with status 2",
            "fix the error above (status 2: bad input), then re-run the same command to resume "
            "from the latest checkpoint",
        ),
    ],
    ids=["killed", "bad_input"],
)
def test_a_failed_process_is_named_by_index_and_the_last_line_says_what_to_do(
    tmp_path: Path, repo_root: Path, ending: str, status: int, how: str, last: str
):
    """The launcher said `process 16534 exited with status 137` (a pid, no process index, no
    signal) and ended there: the trainer's lines say `process 2`, and nothing said what next."""
    python = tmp_path / "python"
    python.write_text(ENDING_PYTHON.format(python=sys.executable, ending=ending))
    python.chmod(0o755)
    env = cpu_env(PYTHON=str(python), LOCAL_DEVICE="cpu", LOCAL_CPU_DEVICES="4")
    done = subprocess.run(
        [str(repo_root / "launch/local.sh"), "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # the others end on the launcher's SIGTERM, long before their sleep
    )
    assert done.returncode == status, done.stderr
    pids = re.search(r"4 processes \(([\d ]+)\)", done.stderr)[1].split()
    lines = done.stderr.splitlines()
    assert f"local.sh: process 1 (pid {pids[1]}) {how}; stopping the others" in lines, lines
    assert lines[-1] == f"local.sh: {last}", lines
