"""`run.stop_exit_status`: the exit status of a run that stops before `run.steps`. A Kubernetes
Job counts a pod that exits 0 as done: with every stop exiting 0, a preempted pod saved, every
process stopped after the same step, every pod exited 0, and the Job was complete, its training
not finished and nothing started again."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import yaml
from conftest import TINY

import trainer.train
from trainer.config import load_config
from trainer.config.schema import TAKEN_EXIT_STATUSES
from trainer.loop import RunResult
from trainer.main import main

STOP = 75  # what launch/k8s/trainer.yaml gives
ARGS = ["--config", "configs/tiny.yaml", *TINY, "run.steps=10", f"run.stop_exit_status={STOP}"]


@pytest.mark.parametrize(("steps_done", "status"), [(4, STOP), (10, 0)])
def test_a_run_ends_with_the_stop_status_only_when_it_stopped_early(
    monkeypatch, capsys, steps_done, status
):
    monkeypatch.setattr(trainer.train, "run", lambda config: RunResult(None, steps_done))
    assert main(ARGS) == status
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"finished at step {steps_done}")


def test_a_stop_during_start_up_ends_with_the_stop_status(monkeypatch, capsys):
    def stopped_while_starting(config):
        signal.raise_signal(signal.SIGTERM)
        pytest.fail("the run went on after a SIGTERM during its start-up")

    monkeypatch.setattr(trainer.train, "run", stopped_while_starting)
    assert main(ARGS) == STOP
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM during start-up")


def test_a_process_of_several_stopped_before_joining_ends_with_the_stop_status(repo_root):
    """Before it has joined JAX's runtime, a process of several ends at once on a SIGTERM."""
    code = textwrap.dedent(f"""
        import signal
        from trainer.preemption import OutsideLoop
        with OutsideLoop(single_process=False, cluster="the cluster", stop_status={STOP}):
            signal.raise_signal(signal.SIGTERM)
        raise SystemExit("the process went on after a SIGTERM")
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == STOP, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM during start-up")


@pytest.mark.parametrize("status", sorted({1, 2, 3, 130, 137, 143}))
def test_a_stop_status_that_already_means_something_is_refused(capsys, status):
    assert main([*ARGS, f"run.stop_exit_status={status}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: run.stop_exit_status={status} already means "), err
    assert len(err.splitlines()) == 1, err


def test_a_sigterm_in_the_loop_saves_and_ends_with_the_stop_status(tmp_path, repo_root):
    """What a preempted pod does: the step under way, a save, the line, and the stop status."""
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.main", *ARGS[:-2], "run.steps=1000", "log.every=1"]
    cmd += ["eval.every=1000", "log.tensorboard=false", f"run.stop_exit_status={STOP}"]
    cmd += [f"run.workdir={workdir}"]
    proc = subprocess.Popen(cmd, cwd=repo_root, env=os.environ, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("step 2:"):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == STOP, "".join(seen)[-2000:] + rest[-2000:]
    last = rest.strip().splitlines()[-1]
    assert last.startswith("finished at step ") and " of 1000: stopped early" in last, rest
    stopped_at = int(last.split()[3])
    assert str(stopped_at) in os.listdir(workdir / "checkpoints"), rest


def test_the_kubernetes_job_starts_a_stopped_pod_again(repo_root):
    """The manifest's pods stop with a status its podFailurePolicy starts again, uncounted."""
    docs = yaml.safe_load_all((repo_root / "launch/k8s/trainer.yaml").read_text())
    job = next(d for d in docs if d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    config = load_config(str(repo_root / container["command"][-1]), container["args"])
    assert config.run.stop_exit_status not in (0, *TAKEN_EXIT_STATUSES)
    ignored = [
        rule["onExitCodes"]
        for rule in job["spec"]["podFailurePolicy"]["rules"]
        if rule["action"] == "Ignore" and "onExitCodes" in rule
    ]
    assert ignored == [{"containerName": container["name"], "operator": "In", "values": [STOP]}]
    assert config.run.stop_exit_status == STOP
    assert pod["restartPolicy"] == "Never"  # what podFailurePolicy requires
