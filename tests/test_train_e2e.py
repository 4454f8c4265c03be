"""End to end: prepare a real (small) corpus, train, checkpoint, resume — through the library and
through the CLI, as a user drives it."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SHARED_SCHEDULE, TINY

from trainer.config import load_config
from trainer.loop import Loop
from trainer.train import run


def read_metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def train_losses(rows):
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_train_learns_checkpoints_and_resumes_exactly(corpus, tmp_path, monkeypatch):
    def config(workdir, steps):
        return load_config(
            None,
            [
                *TINY,
                f"data.path={corpus}",
                f"run.workdir={workdir}",
                f"run.steps={steps}",
                "checkpoint.every=10",
                "eval.every=10",
                "optim.decay_steps=40",  # conftest.SHARED_SCHEDULE: a compiled step others share
            ],
        )

    straight = tmp_path / "straight"
    # The loop moves data to and from the devices only explicitly (the feed's device_put, the
    # metrics' device_get): an implicit transfer in the hot path fails here.
    unguarded = Loop.train

    def guarded_train(self, *args, **kwargs):
        with jax.transfer_guard("disallow"):
            return unguarded(self, *args, **kwargs)

    monkeypatch.setattr(Loop, "train", guarded_train)
    result = run(config(straight, 40))
    monkeypatch.undo()
    rows = read_metrics(straight)
    losses = train_losses(rows)
    assert sorted(losses) == list(range(1, 41))
    assert np.mean([losses[s] for s in range(36, 41)]) < losses[1] - 1.0  # it learns
    needed = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_frac"}
    assert all(needed <= set(r) for r in rows if "loss" in r)
    assert [r["step"] for r in rows if "eval_loss" in r] == [10, 20, 30, 40]
    assert [r["step"] for r in rows if "ckpt_block_s" in r] == [10, 20, 30, 40]
    assert result.eval_loss is not None and np.isfinite(result.eval_loss)
    assert (straight / "config.yaml").is_file()
    assert any((straight / "tb").iterdir())

    # Stop at 20, then resume to 40: the resumed losses equal the straight run bit for bit.
    resumed = tmp_path / "resumed"
    run(config(resumed, 20))
    assert sorted(int(p.name) for p in (resumed / "checkpoints").iterdir() if p.name.isdigit())
    run(config(resumed, 40))
    after = train_losses(read_metrics(resumed))
    assert [after[s] for s in range(21, 41)] == [losses[s] for s in range(21, 41)]


@pytest.mark.slow
def test_cli_run_then_resume(corpus, tmp_path, repo_root):
    workdir = tmp_path / "cli"

    def cli(steps):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer.main",
                "--config",
                "configs/tiny.yaml",
                f"data.path={corpus}",
                f"run.workdir={workdir}",
                f"run.steps={steps}",
                SHARED_SCHEDULE,  # the resume compiles nothing new
                "checkpoint.every=5",
                "eval.every=5",
                "log.every=5",
            ],
            cwd=repo_root,
            capture_output=True,
            text=True,
            timeout=300,
        )

    first = cli(10)
    assert first.returncode == 0, first.stderr[-2000:]
    second = cli(15)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming from" in second.stderr and "(step 10)" in second.stderr
    steps = [r["step"] for r in read_metrics(workdir) if "loss" in r]
    assert steps == [5, 10, 15]
    assert "already at step 15" in cli(15).stderr


def two_step_settings(corpus) -> list[str]:
    return [
        *TINY,
        f"data.path={corpus}",
        "run.steps=2",
        SHARED_SCHEDULE,
        "checkpoint.every=2",
        "eval.every=2",
    ]


@pytest.fixture(scope="module")
def two_step_run(corpus, tmp_path_factory) -> Path:
    """A finished 2-step run of the TINY model, its checkpoint at step 2: made once for the
    tests that resume from it, each in its own copy (`copy_of`)."""
    workdir = tmp_path_factory.mktemp("two_steps") / "w"
    run(load_config(None, [*two_step_settings(corpus), f"run.workdir={workdir}"]))
    return workdir


def copy_of(two_step_run: Path, workdir: Path) -> Path:
    shutil.copytree(two_step_run, workdir)
    return workdir


def test_checkpoint_from_another_model_is_refused(corpus, two_step_run, tmp_path):
    from trainer.errors import TrainingError

    workdir = copy_of(two_step_run, tmp_path / "w")
    base = [*two_step_settings(corpus), f"run.workdir={workdir}"]
    with pytest.raises(TrainingError, match=r"from another model .*saved \[2, 64"):
        run(load_config(None, [*base, "run.steps=4", "model.d_ff=96"]))


def test_a_refused_resume_leaves_the_runs_config_yaml(corpus, two_step_run, tmp_path):
    # The refusal says "use ... the model config it was saved with": config.yaml still shows it.
    from trainer.errors import TrainingError

    workdir = copy_of(two_step_run, tmp_path / "w")
    base = [*two_step_settings(corpus), f"run.workdir={workdir}"]
    saved = (workdir / "config.yaml").read_text()
    with pytest.raises(TrainingError, match="from another model"):
        run(load_config(None, [*base, "run.steps=4", "model.d_ff=96"]))
    assert (workdir / "config.yaml").read_text() == saved


def test_init_from_another_model_or_no_checkpoint_names_checkpoint_init_from(
    corpus, two_step_run, tmp_path
):
    # The fix is the init_from path (or the model config), not run.workdir: the workdir is new.
    from trainer.errors import TrainingError

    base = two_step_settings(corpus)
    source, empty = copy_of(two_step_run, tmp_path / "source"), tmp_path / "empty"
    empty.mkdir()
    tuned = [*base, f"run.workdir={tmp_path / 'tuned'}"]
    with pytest.raises(
        TrainingError,
        match=r"from another model .*saved \[2, 64.*\); point checkpoint.init_from at a run of "
        r"this model, or set the model.\* config it was saved with$",
    ):
        run(load_config(None, [*tuned, f"checkpoint.init_from={source}", "model.d_ff=96"]))
    with pytest.raises(
        TrainingError,
        match=r"holds no complete checkpoint; point checkpoint.init_from at the run.workdir of a "
        "past run$",
    ):
        run(load_config(None, [*tuned, f"checkpoint.init_from={empty}"]))


def test_dataset_vocab_larger_than_model_is_a_config_error(corpus, tmp_path):
    from trainer.errors import ConfigError

    config = load_config(
        None, [*TINY, f"data.path={corpus}", f"run.workdir={tmp_path}", "model.vocab_size=100"]
    )
    with pytest.raises(ConfigError, match="model.vocab_size=100 is smaller"):
        run(config)


def test_an_interrupt_that_aborts_is_one_line_not_a_traceback(monkeypatch, capsys):
    """A second Ctrl-C (or one before the loop starts) used to end in a KeyboardInterrupt
    traceback; it is one line saying nothing was saved and how to resume, with exit 130."""
    import trainer.train
    from trainer.main import main

    def interrupted(config):
        raise KeyboardInterrupt("second SIGINT: aborting without saving")

    monkeypatch.setattr(trainer.train, "run", interrupted)
    assert main(["--config", "configs/tiny.yaml"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted without saving; re-run the same command")
    assert "Traceback" not in err


def test_an_interrupt_inside_the_save_task_is_not_logged_again_at_exit(tmp_path, repo_root):
    """A second Ctrl-C during a save is raised inside Orbax's asyncio task; asyncio logged it
    again, with ~75 lines of traceback, when it collected that task at exit."""
    script = tmp_path / "interrupted_save.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, sys
            import trainer.train
            from trainer.main import main

            async def save():  # where the second SIGINT's KeyboardInterrupt is raised
                raise KeyboardInterrupt("second SIGINT: aborting without saving")

            async def run_sync():  # as orbax's asyncio_utils.run_sync wraps it: its own task
                return await asyncio.ensure_future(save())

            trainer.train.run = lambda config: asyncio.new_event_loop().run_until_complete(
                run_sync()
            )
            sys.exit(main(["--config", "configs/tiny.yaml"]))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=repo_root
    )
    assert done.returncode == 130
    assert done.stderr.startswith("interrupted without saving; re-run the same command")
    assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr


def test_a_step_that_does_not_fit_in_memory_is_one_line(monkeypatch, capsys):
    """XLA's RESOURCE_EXHAUSTED (e.g. data.seq_len=8192 on the demo model: 25 GB of attention)
    used to end the CLI in a traceback; it is one line pointing at what shrinks a step."""
    import trainer.train
    from trainer.main import main

    def too_big(config):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 25769803776 bytes.\nmore"
        )

    monkeypatch.setattr(trainer.train, "run", too_big)
    assert main(["--config", "configs/tiny.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the step does not fit in device memory (RESOURCE_EXHAUSTED")
    assert "python -m trainer.plan" in err and "more" not in err
