"""A SIGTERM during a run's start-up (data preparation or loading, model build, compile, restore)
ends it at once with one line and exit 0, as a stop in the loop does, leaving nothing half-written:
its default action killed the process without a word (exit 143 in a Slurm log)."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import SHARED_SCHEDULE, TINY

STARTUP_LINE = "stopped by SIGTERM during start-up, before this session's first step"


@pytest.mark.slow
def test_sigterm_during_startup_is_one_line_and_the_rerun_starts(tmp_path, repo_root):
    """The signal comes while the run prepares the built-in corpus on first use (seconds)."""
    cache = tmp_path / "cache"
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml", *TINY]
    cmd += ["data.path=python-docstrings", "run.steps=1", SHARED_SCHEDULE, "eval.every=100"]
    cmd += ["log.tensorboard=false", f"run.workdir={workdir}"]
    env = {**os.environ, "ACCEL_TRAINER_CACHE": str(cache)}
    proc = subprocess.Popen(cmd, cwd=repo_root, env=env, stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    assert first.startswith("preparing built-in corpus"), first
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == 0, rest[-2000:]
    assert rest.strip().splitlines()[-1].startswith(STARTUP_LINE), rest[-2000:]
    assert "Traceback" not in rest
    made = [p.name for p in cache.iterdir()] if cache.exists() else []
    assert not [name for name in made if ".tmp-" in name]  # no half-made dataset
    assert not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())

    rerun = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert rerun.stderr.strip().splitlines()[-1].startswith("finished at step 1")


# Sends SIGTERM 0.3 s into the compile of the state's init, as a preemption notice may come.
SIGNALLED_WHILE_COMPILING = """
import os, signal, sys, threading
from jax._src import compiler
compile_and_load = compiler.backend_compile_and_load
def signalled_while_compiling(backend, module, *args, **kwargs):
    if "jit_init" in str(module.operation.attributes["sym_name"]):
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return compile_and_load(backend, module, *args, **kwargs)
compiler.backend_compile_and_load = signalled_while_compiling
import runpy
runpy.run_module("trainer.main", run_name="__main__", alter_sys=True)
"""


def test_sigterm_while_compiling_ends_with_one_line_not_a_segfault(tmp_path, repo_root):
    """jax waits for a compile in a way the signal leaves; Python's exit then tore the runtime
    down under XLA's compile threads: the line, then a segfault (exit -11, 139 in a shell), read
    as a crash by Kubernetes and Slurm. The compile cache is off, so the compile happens, on one
    device, as a GPU process has one (with 8 fake CPU devices the exit did not crash)."""
    cmd = [sys.executable, "-c", SIGNALLED_WHILE_COMPILING, "--config", "configs/tiny.yaml"]
    cmd += [*TINY, "run.steps=2", "log.tensorboard=false", f"run.workdir={tmp_path / 'run'}"]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    run = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith(STARTUP_LINE), run.stderr[-2000:]
    assert "Traceback" not in run.stderr
