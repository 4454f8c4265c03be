"""data.skip_corrupt with Grain workers and no shuffle: a worker that only ever meets unreadable
records must neither hang the run nor stop it while other records are readable.

Unshuffled, worker i of W takes reads i, i+W, ...; with W x (records per read) a multiple of the
records, each worker reads the same records forever. These datasets hold 4 train records of
2^19 tokens, so a read is 2 records (`READ_TOKENS` / 2^19) and, with 2 workers, worker 0 reads
records 0-1 (train shard 0) and worker 1 records 2-3 (shard 1), every time."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FOUR_RECORD_TOKENS, garble_records

from input_pipeline.pipeline import READ_TOKENS
from input_pipeline.shares import worker_share

RUN_TIMEOUT_S = 240  # a healthy run takes seconds; the hang it guards against never ends


def damaged_copy(dataset: Path, folder: Path, shards: list[int]) -> Path:
    copy = folder / "damaged"
    shutil.copytree(dataset, copy)
    for index in shards:
        garble_records(next(copy.glob(f"train-{index:05d}-*")))
    return copy


def overrides(data: Path, workdir: Path, workers: int) -> list[str]:
    """A 3-step run of configs/tiny.yaml on `data`, unshuffled, skipping damaged records."""
    return [
        f"data.path={data}",
        "data.shuffle=false",
        f"data.workers={workers}",
        "data.skip_corrupt=true",
        "run.steps=3",
        "log.every=1",
        "checkpoint.every=100",
        "eval.every=100",
        "log.tensorboard=false",
        f"run.workdir={workdir}",
    ]


def train(data: Path, workdir: Path, workers: int, repo_root: Path) -> tuple[int, str, list]:
    """A 3-step CLI run on `data` (unshuffled, skipping damaged records): its exit code, stderr
    and metrics rows; a run still going after `RUN_TIMEOUT_S` is killed with its workers and
    fails the test."""
    cmd = [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml"]
    cmd += overrides(data, workdir, workers)
    proc = subprocess.Popen(
        cmd, cwd=repo_root, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its Grain worker processes
        proc.communicate()
        pytest.fail(f"data.workers={workers} run still going after {RUN_TIMEOUT_S} s: it hung")
    return proc.returncode, err, train_rows(workdir)


def train_rows(workdir: Path) -> list[dict]:
    metrics = workdir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [row for row in map(json.loads, lines) if "loss" in row]


def train_alone_in_this_process(data: Path, workdir: Path, repo_root: Path) -> list[dict]:
    """The same run with `data.workers=0`, through the library in the test's own process (an
    error raises): the reference the worker runs are compared with, whose process (no workers)
    is not what the tests are about and which a new process makes seconds longer."""
    from trainer.config import load_config
    from trainer.train import run

    run(load_config(repo_root / "configs/tiny.yaml", overrides(data, workdir, workers=0)))
    return train_rows(workdir)


def test_this_layout_gives_each_worker_a_fixed_half(four_records):
    """The premise of the tests below: 2 records per read, each of 2 workers reaching 2 of 4."""
    per_read = round(READ_TOKENS / FOUR_RECORD_TOKENS)
    assert per_read == 2 and worker_share(4, per_read, 2, shuffle=False) == 2
    assert worker_share(4, per_read, 2, shuffle=True) == worker_share(4, per_read, 0, False) == 4


@pytest.mark.slow
def test_a_worker_whose_records_are_all_unreadable_leaves_the_others_training(
    four_records, tmp_path, repo_root
):
    """Before: worker 0 skipped its two bad records forever and the run never took a step."""
    data = damaged_copy(four_records, tmp_path, shards=[0])
    code, err, rows = train(data, tmp_path / "workers2", 2, repo_root)
    assert code == 0, err
    assert "leaked shared_memory" not in err  # the run waited for Grain's unlinks
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["corrupt_records_skipped"] == 2
    # the same batches as one reader skipping the same records: records 2-3, over and over
    alone = train_alone_in_this_process(data, tmp_path / "workers0", repo_root)
    assert [r["loss"] for r in rows] == [r["loss"] for r in alone]


@pytest.mark.slow
def test_no_readable_record_with_workers_is_one_line(four_records, tmp_path, repo_root):
    """Before: no worker ever met all 4 records, so none said that none is readable: a hang."""
    data = damaged_copy(four_records, tmp_path, shards=[0, 1])
    code, err, rows = train(data, tmp_path / "run", 2, repo_root)
    assert code == 2 and not rows
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: none of the 4 records of ") and "is readable" in last
    assert last.endswith("re-run python -m input_pipeline.prepare --overwrite")
