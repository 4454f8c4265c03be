"""`corrupt_records_skipped` is the run's count: each process lists the records it skipped in its
own `skipped_records.<process>.jsonl`, and process 0, which writes the metrics, counts them all
(the workdir is shared), so two processes report what one does on the same damaged data."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import garble_records

from input_pipeline.records import SkippedCount, append_line
from trainer.config import load_config
from trainer.train import run


def entry(record: int) -> str:
    return json.dumps({"shard": "/data/train-00000-of-00002.arrayrecord", "record": record})


def test_the_count_reads_every_process_log_beside_its_own(tmp_path):
    count = SkippedCount(tmp_path / "skipped_records.0.jsonl")
    append_line(str(tmp_path / "skipped_records.0.jsonl"), entry(0))
    append_line(str(tmp_path / "skipped_records.1.jsonl"), entry(1))
    append_line(str(tmp_path / "skipped_records.notes.jsonl"), entry(9))  # not a process's log
    assert count() == 2
    append_line(str(tmp_path / "skipped_records.1.jsonl"), entry(0))  # the same record: once
    append_line(str(tmp_path / "skipped_records.2.jsonl"), entry(2))  # a log that came later
    assert count() == 3
    (tmp_path / "skipped_records.1.jsonl").write_text("")  # one replaced: all counted afresh
    assert count() == 2


@pytest.fixture(scope="module")
def damaged_records(four_records, tmp_path_factory) -> Path:
    """The 4 records in 2 shards with shard 0 (records 0-1) garbled: with two processes
    (records index::2) each reads one bad record of its two."""
    copy = tmp_path_factory.mktemp("data") / "damaged"
    shutil.copytree(four_records, copy)
    garble_records(next(copy.glob("train-00000-*")))
    return copy


def run_args(data: Path, workdir: Path) -> list[str]:
    return [
        "--config",
        "configs/tiny.yaml",
        f"data.path={data}",
        "data.skip_corrupt=true",
        "data.streams=2",  # the same two streams however many processes read them
        "run.steps=2",
        "log.every=1",
        "checkpoint.every=100",
        "eval.every=100",
        "log.tensorboard=false",
        f"run.workdir={workdir}",
    ]


def skipped_counts(workdir: Path) -> list[int]:
    rows = map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
    return [row["corrupt_records_skipped"] for row in rows if "loss" in row]


@pytest.mark.slow
def test_two_processes_count_the_records_both_skipped(damaged_records, tmp_path, repo_root):
    """Before: process 0 counted only its own log, 1 of the 2 records the run skipped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))}
    env["XLA_FLAGS"] = ""
    env.update(PYTHON=sys.executable, JAX_PLATFORMS="cpu", LOCAL_CPU_DEVICES="2")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    two = tmp_path / "two"
    cmd = [str(repo_root / "launch/local.sh"), "2", *run_args(damaged_records, two)]
    done = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in two.glob("skipped_records.*")) == [
        "skipped_records.0.jsonl",
        "skipped_records.1.jsonl",
    ]
    # the one-process reference, through the library in this process (an error raises): its
    # process is not what the test is about, and a new one makes it seconds longer
    one = tmp_path / "one"
    config_file, *overrides = run_args(damaged_records, one)[1:]  # the CLI's, past "--config"
    run(load_config(repo_root / config_file, overrides))
    assert skipped_counts(two)[-1] == skipped_counts(one)[-1] == 2
