"""Checkpoints that never lose work: clean stops, NaN guards, resharding, retention, export."""

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SHARED_SCHEDULE, TINY, tiny_cli

from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import CheckpointConfig, load_config
from trainer.errors import TrainingError
from trainer.export import export_params
from trainer.export import main as export_main
from trainer.generate import load_generator
from trainer.models import builder_for_vocab
from trainer.observe.metrics import read_metrics
from trainer.parallel import sharding
from trainer.program import build_program
from trainer.train import run


def rows_of(workdir: Path) -> list[dict]:
    return read_metrics(workdir / "metrics.jsonl").rows


def losses_of(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows_of(workdir) if "loss" in r}


def saved_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def uninterrupted_run(repo_root, args, workdir):
    """The reference: the same tiny run through the library, never stopped."""
    return run_in_this_process(repo_root, args, workdir)


def run_in_this_process(repo_root, args, workdir):
    """The run `tiny_cli(args, workdir)` starts, through the library in the test's own process
    (a run that fails raises): for the runs whose process is not what a test is about (a
    reference, or the re-run after a stop or kill), which a new process makes seconds longer."""
    run(
        load_config(
            repo_root / "configs/tiny.yaml", [*args, f"run.workdir={workdir}", "log.progress=false"]
        )
    )
    return workdir


def base(corpus, workdir, *extra):
    return load_config(None, [*TINY, f"data.path={corpus}", f"run.workdir={workdir}", *extra])


@pytest.fixture(scope="module")
def tfrecord_corpus(tmp_path_factory) -> Path:
    """Part of the stdlib corpus, prepared as TFRecord."""
    from input_pipeline.prepare import prepare_dataset

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    out = tmp_path_factory.mktemp("data") / "stdlib-tfrecord"
    return prepare_dataset(texts, out, eval_fraction=0.05, format="tfrecord", progress=False)


@pytest.mark.slow
# None: ArrayRecord data; grain: TFRecord data through the default reader. The tf.data reader's
# exact resume is tested at the iterator level in test_tfrecord.py (its end-to-end run adds ~60 s).
# float16: ArrayRecord data in fp16 compute, the loss scale doubling every 4 clean steps, so the
# resumed run must also continue the scale and its counter exactly.
@pytest.mark.parametrize("variant", [None, "grain", "float16"])
def test_sigterm_saves_and_resume_is_bit_identical(corpus, tmp_path, repo_root, variant, request):
    data = [f"data.path={corpus}"]
    if variant == "grain":
        data = [f"data.path={request.getfixturevalue('tfrecord_corpus')}", "data.reader=grain"]
    if variant == "float16":
        data += ["precision.compute=float16", "precision.loss_scale_period=4"]
    args = [
        *data,
        "run.steps=40",
        SHARED_SCHEDULE,
        "checkpoint.every=100",
        "eval.every=100",
        "log.every=1",
    ]
    straight = uninterrupted_run(repo_root, args, tmp_path / "straight")
    expected = losses_of(straight)

    workdir = tmp_path / "stopped"
    cmd = tiny_cli(args, workdir)
    proc = subprocess.Popen(cmd, cwd=repo_root, stderr=subprocess.PIPE, text=True)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(losses_of(workdir)) >= 5):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    stopped_at = saved_steps(workdir)[-1]
    assert 5 <= stopped_at < 40
    assert f"stopped by SIGTERM at step {stopped_at}" in stderr
    last = f"finished at step {stopped_at} of 40: stopped early, re-run the same command to resume"
    assert stderr.strip().splitlines()[-1] == last, "not a plain 'finished' short of run.steps"

    run_in_this_process(repo_root, args, workdir)  # the resume: it ends without an error
    got = losses_of(workdir)
    assert [got[s] for s in range(stopped_at + 1, 41)] == [
        expected[s] for s in range(stopped_at + 1, 41)
    ]
    if variant == "float16":
        scales = {r["step"]: r["loss_scale"] for r in rows_of(straight) if "loss_scale" in r}
        resumed_scales = {r["step"]: r["loss_scale"] for r in rows_of(workdir) if "loss_scale" in r}
        assert resumed_scales == scales and len(set(scales.values())) > 1  # it moved, and resumed


def test_nan_loss_stops_with_the_step_and_keeps_good_checkpoints(corpus, tmp_path):
    config = base(
        corpus,
        tmp_path,
        "optim.lr=1e30",
        "optim.warmup_steps=1",
        "run.steps=10",
        "checkpoint.every=1",
        "eval.every=100",
    )
    with pytest.raises(
        TrainingError,
        match=r"(loss is (nan|inf)|parameters became non-finite) at step \d+; it is not saved "
        r"\(earlier checkpoints are kept\).*token ids must be below the model's vocabulary",
    ):
        run(config)
    steps = saved_steps(tmp_path)
    assert steps, "the good steps before the NaN were saved"
    import orbax.checkpoint as ocp

    for step in steps:  # every checkpoint left behind holds finite parameters
        params = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / str(step) / "params")
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_skip_nonfinite_skips_and_counts(corpus, tmp_path):
    config = base(
        corpus,
        tmp_path,
        "optim.lr=1e30",
        "optim.warmup_steps=1",
        "run.steps=6",
        "optim.skip_nonfinite=true",
        "checkpoint.every=100",
        "eval.every=100",
    )
    run(config)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if "loss" in r][-1]["skipped_steps"] > 0


def test_restore_onto_another_mesh_reshards(tmp_path):
    config = load_config(None, TINY)
    devices = jax.devices()

    def program(data, fsdp, count):
        derived = config.derive({"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": 1})
        mesh = sharding.make_mesh(derived.mesh, devices[:count])
        return build_program(derived, mesh, builder_for_vocab(derived, 256))

    saver = program(1, 8, 8)
    state = saver.init()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    checkpointer.save(3, state, {"position": 7}, {"param_shapes": param_shapes(state.params)})
    checkpointer.close()

    loader = program(2, 2, 4)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    restored, data_state, _ = checkpointer.restore(3, loader.abstract_state())
    checkpointer.close()
    assert data_state == {"position": 7}
    assert int(restored.step) == 0
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kernel = restored.params["blocks"]["mlp"]["up"]["kernel"]
    assert len(kernel.sharding.device_set) == 4


def test_keep_every_and_export_for_plain_orbax(corpus, tmp_path):
    workdir = tmp_path / "run"
    run(
        base(
            corpus,
            workdir,
            "run.steps=8",
            SHARED_SCHEDULE,
            "checkpoint.every=2",
            "checkpoint.keep=1",
            "checkpoint.keep_every=4",
            "eval.every=100",
        )
    )
    assert saved_steps(workdir) == [4, 8]

    out = tmp_path / "exported"
    # the export CLI's main, in this process; the reader below is a process of its own
    assert export_main(["--workdir", str(workdir), "--out", str(out)]) == 0
    reader = (
        "import sys, orbax.checkpoint as ocp, numpy as np\n"
        "p = ocp.StandardCheckpointer().restore(sys.argv[1])\n"
        "print(np.asarray(p['embed']['embedding']).shape, 'trainer' in sys.modules)\n"
    )
    plain = subprocess.run(
        [sys.executable, "-c", reader, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.strip().endswith("(256, 64) False")
    unsaved = f"{workdir / 'checkpoints'} has no step 6; saved steps: [4, 8]"
    with pytest.raises(TrainingError) as export_info:
        export_params(workdir, tmp_path / "again", step=6)
    with pytest.raises(TrainingError) as generate_info:
        load_generator(str(workdir), step=6)
    assert str(export_info.value) == str(generate_info.value) == unsaved


def test_init_from_starts_from_another_runs_parameters(corpus, tmp_path):
    first = tmp_path / "first"
    run(
        base(
            corpus, first, "run.steps=30", SHARED_SCHEDULE, "checkpoint.every=30", "eval.every=100"
        )
    )
    tuned = tmp_path / "tuned"
    init_from = f"checkpoint.init_from={first}"
    run(base(corpus, tuned, "run.steps=1", SHARED_SCHEDULE, init_from, "eval.every=100"))
    fresh = tmp_path / "fresh"
    run(base(corpus, fresh, "run.steps=1", SHARED_SCHEDULE, "eval.every=100"))
    assert losses_of(tuned)[1] < losses_of(fresh)[1] - 1.0


def test_unwritable_workdir_is_reported(corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(TrainingError, match="cannot write run.workdir"):
        run(base(corpus, blocker / "run"))


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing(corpus, tmp_path, repo_root):
    """Killed 5 times (some kills land inside a save), the run still ends exactly like an
    uninterrupted one: every restart resumes from the latest complete checkpoint."""
    args = [
        f"data.path={corpus}",
        "run.steps=24",
        SHARED_SCHEDULE,
        "checkpoint.every=2",
        "eval.every=100",
        "log.every=1",
    ]
    straight = uninterrupted_run(repo_root, args, tmp_path / "straight")
    workdir = tmp_path / "killed"
    cmd = tiny_cli(args, workdir)
    rng = np.random.default_rng(0)
    resumed_from = []

    def lines_written():
        path = workdir / "metrics.jsonl"
        return path.read_text().count("\n") if path.exists() else 0

    for _ in range(5):
        before = lines_written()
        proc = subprocess.Popen(cmd, cwd=repo_root, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120  # wait until this attempt trains, then kill at random
        while time.time() < deadline and proc.poll() is None and lines_written() <= before:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        proc.kill()
        _, stderr = proc.communicate(timeout=60)
        if "resuming from" in stderr:
            resumed_from.append(int(stderr.split("(step ")[1].split(")")[0]))
    run_in_this_process(repo_root, args, workdir)  # the final run: it ends without an error
    assert resumed_from == sorted(resumed_from) and len(resumed_from) >= 3
    assert not [p for p in (workdir / "checkpoints").iterdir() if "tmp" in p.name]
    assert losses_of(workdir)[24] == losses_of(straight)[24]


# Runs the CLI with Checkpointer.save patched to SIGKILL the process the moment the save of step
# $KILL_AT_STEP has committed: the one window where that step is the resume point already.
KILLED_AFTER_COMMIT = """
import os, signal, sys
from trainer import main
from trainer.checkpoint import Checkpointer

save = Checkpointer.save

def save_then_die(self, step, *args, **kwargs):
    blocked = save(self, step, *args, **kwargs)
    if step == int(os.environ["KILL_AT_STEP"]):
        self.wait()  # committed: a re-run resumes from this step
        os.kill(os.getpid(), signal.SIGKILL)
    return blocked

Checkpointer.save = save_then_die
sys.exit(main.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_right_after_a_checkpoint_commits_loses_no_metrics_line(
    corpus, tmp_path, repo_root, capfd
):
    """The resume point's own metrics line is on disk before its checkpoint commits, so a kill
    just after the commit leaves every step logged exactly once after the re-run."""
    args = [f"data.path={corpus}", "run.steps=8", "checkpoint.every=3", "log.every=1"]
    args += ["eval.every=100", SHARED_SCHEDULE]
    straight = uninterrupted_run(repo_root, args, tmp_path / "straight")
    workdir = tmp_path / "killed"
    cli_args = ["--config", "configs/tiny.yaml", *args, f"run.workdir={workdir}"]
    env = {**os.environ, "KILL_AT_STEP": "6"}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_COMMIT, *cli_args],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert saved_steps(workdir) == [3, 6]
    assert max(losses_of(workdir)) == 6  # the resume point's line made it, nothing after it
    capfd.readouterr()
    run_in_this_process(repo_root, args, workdir)  # the re-run: it ends without an error
    final_stderr = capfd.readouterr().err
    assert "resuming from" in final_stderr, final_stderr[-2000:]
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows if "loss" in r]
    assert logged == list(range(1, 9))  # every step once: none lost, none repeated
    assert losses_of(workdir) == losses_of(straight)
