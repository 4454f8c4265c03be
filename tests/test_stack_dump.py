"""`kill -USR1 <pid>` shows where a running `python -m trainer.main` is, without stopping it:
every thread's Python stack on stderr, and the run trains on to its last step."""

import signal
import subprocess
import sys

from conftest import TINY


def test_sigusr1_prints_every_threads_stack_and_the_run_goes_on(corpus, tmp_path, repo_root):
    cmd = [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml", *TINY]
    cmd += [f"data.path={corpus}", f"run.workdir={tmp_path / 'run'}", "run.steps=30"]
    cmd += ["log.every=1", "eval.every=100", "log.tensorboard=false", "log.progress=false"]
    proc = subprocess.Popen(cmd, cwd=repo_root, stderr=subprocess.PIPE, text=True)
    before = []
    while not (line := proc.stderr.readline()).startswith("step 1:"):
        assert line, f"the run ended before its first step: {''.join(before)[-2000:]}"
        before.append(line)
    proc.send_signal(signal.SIGUSR1)
    rest = proc.stderr.read()
    proc.wait(timeout=120)

    assert proc.returncode == 0, rest[-3000:]
    assert "Current thread" in rest and "(most recent call first)" in rest, rest[-3000:]
    assert rest.count("Thread 0x") >= 1, "the other threads' stacks too (readers, Orbax)"
    assert rest.strip().splitlines()[-1].startswith("finished at step 30"), rest[-2000:]
