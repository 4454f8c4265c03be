"""A session at the edges of a run: a dataset prepared without an eval split trains without evals
(one line says so at the start) and still saves its final checkpoint; running a finished run again
changes nothing, its summary.json included."""

import json
import sysconfig
from pathlib import Path

import pytest
from conftest import TINY

from trainer.config import load_config
from trainer.train import run


def rows_of(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def saved_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def train_only_corpus(tmp_path_factory) -> Path:
    """Real text prepared as `prepare --eval-fraction 0` does: a train split and no other."""
    from input_pipeline.prepare import prepare_dataset

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in sorted(stdlib.glob("*.py"))]
    out = tmp_path_factory.mktemp("data") / "train-only"
    prepare_dataset(texts[:40], out, eval_fraction=0.0, progress=False)
    assert list(json.loads((out / "dataset.json").read_text())["splits"]) == ["train"]
    return out


@pytest.mark.slow
def test_a_dataset_without_an_eval_split_trains_without_evals(train_only_corpus, tmp_path, capfd):
    workdir = tmp_path / "run"
    args = [f"data.path={train_only_corpus}", f"run.workdir={workdir}", "log.tensorboard=false"]
    args += ["run.steps=4", "checkpoint.every=2", "eval.every=2"]
    result = run(load_config(None, [*TINY, *args]))
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "without evals" in line] == [
        f"data {train_only_corpus} has no eval split; training without evals (prepare it with "
        "--eval-fraction or --eval-input to get eval_loss)"
    ], err[-2000:]
    assert result.step == 4 and result.eval_loss is None
    assert saved_steps(workdir) == [2, 4], "the final checkpoint is saved"
    rows = rows_of(workdir)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert not [r for r in rows if "eval_loss" in r]


@pytest.mark.slow
def test_running_a_finished_run_again_keeps_its_summary(corpus, tmp_path, capfd):
    """A session that trains no step leaves the last session's summary.json as it was: a re-run
    of a finished job is a no-op, as in torchtitan and MaxText."""
    workdir = tmp_path / "run"
    args = [*TINY, f"data.path={corpus}", f"run.workdir={workdir}", "log.tensorboard=false"]
    args += ["run.steps=3", "checkpoint.every=3", "eval.every=3"]
    run(load_config(None, args))
    summary = (workdir / "summary.json").read_text()
    assert json.loads(summary)["steps"] == 3 and json.loads(summary)["eval_loss"] is not None
    capfd.readouterr()
    result = run(load_config(None, args))
    err = capfd.readouterr().err
    assert result.step == 3
    assert (workdir / "summary.json").read_text() == summary
    assert "run already at step 3 >= run.steps=3" in err
    assert "where the time went" not in err, "no table for a session that did nothing"


@pytest.mark.slow
def test_resuming_on_other_data_says_so(corpus, train_only_corpus, tmp_path, capfd):
    """Every checkpoint records its dataset's fingerprint; a resume on another dataset used to
    carry the saved read position over without a word."""
    workdir = tmp_path / "run"
    args = [*TINY, f"run.workdir={workdir}", "log.tensorboard=false", "checkpoint.every=2"]
    run(load_config(None, [*args, f"data.path={corpus}", "run.steps=2"]))
    run(load_config(None, [*args, f"data.path={corpus}", "run.steps=3"]))
    assert "trained on other data" not in capfd.readouterr().err
    run(load_config(None, [*args, f"data.path={train_only_corpus}", "run.steps=4"]))
    warnings = [line for line in capfd.readouterr().err.splitlines() if "other data" in line]
    assert len(warnings) == 1 and f"checkpoint.init_from={workdir}" in warnings[0], warnings
