"""`python -m trainer.main` writes each of its lines in one write: several processes sharing a
terminal or a log (launch/local.sh, one Slurm output file) then never split each other's lines,
even under PYTHONUNBUFFERED=1, with which `print` writes the text and its newline apart."""

import ast
import subprocess
import sys

# Runs the CLI as `python -m` does, with a stderr that records each write reaching the file
# descriptor and is unbuffered the way PYTHONUNBUFFERED=1 makes it; then reports those writes.
RECORDED_CLI = """\
import io, os, runpy, sys

class RecordedWrites(io.RawIOBase):
    def __init__(self):
        self.writes = []
    def writable(self):
        return True
    def write(self, data):
        self.writes.append(bytes(data))
        return len(data)

raw = RecordedWrites()
sys.stderr = io.TextIOWrapper(raw, write_through=True)
sys.argv = ["trainer.main", "--config", "configs/demo.yaml", "optim.lrr=1"]
try:
    runpy.run_module("trainer.main", run_name="__main__")
except SystemExit as stop:
    os.write(1, repr((stop.code, raw.writes)).encode())
"""


def test_an_error_line_is_one_write_when_output_is_unbuffered(repo_root):
    proc = subprocess.run(
        [sys.executable, "-c", RECORDED_CLI],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    status, writes = ast.literal_eval(proc.stdout)
    assert status == 2, proc.stderr
    assert len(writes) == 1 and writes[0].startswith(b"error: unknown key optim.lrr"), writes
    assert writes[0].endswith(b"\n")
