"""The benchmark scripts start the way BENCHMARKS.md runs them (`python benchmarks/X.py`): a
script whose folder shadows a package (benchmarks/input_pipeline.py vs `input_pipeline`) once
broke every other benchmark at import."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_imports_and_parses_arguments(script):
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_packing_padding_measures_a_prepared_dataset(tmp_path):
    """The bound's padding table for a user's prepared folder: one row per packing, padding
    falling as the bound rises, none added by concat packing without a bound."""
    from conftest import documents

    from input_pipeline.prepare import prepare_dataset

    folder = prepare_dataset(
        documents(), tmp_path / "ds", eval_fraction=0.1, max_record_tokens=512, progress=False
    )
    done = subprocess.run(
        [sys.executable, "benchmarks/packing_padding.py", "--corpora", str(folder)]
        + ["--seq-lens", "256", "--bounds", "1", "2", "--batch-size", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if str(folder) in line]
    assert [row[1].strip() for row in rows] == ["concat", "first_fit"]
    for row in rows:
        one, two, unbounded = (float(cell) for cell in row[4:7])
        assert one > two >= unbounded >= 0
    assert float(rows[0][6]) < 0.5  # concat pads only the data's last row


def test_loop_overhead_reports_every_part(tmp_path):
    """benchmarks/loop_overhead.py at toy sizes: the null-step loop, first vs later saves cold
    and warmed up, and the real loop against its bare step (the accelerator code path, here on
    CPU); each prints its figures."""
    args = ["--steps", "30", "--rounds", "1", "--shapes", "8x64", "--first-save-width", "32"]
    done = subprocess.run(
        [sys.executable, "benchmarks/loop_overhead.py", *args, "--real", "tiny"]
        + ["--real-steps", "12"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "ACCEL_TRAINER_CACHE": str(tmp_path)},  # the built-in corpus
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for part in (
        "null step 8x64: loop",
        "first save cold:",
        "first save after warm_up:",
        "real tiny",
    ):
        line = next(line for line in out.splitlines() if part in line)
        numbers = [float(x) for x in re.findall(r"\d+\.\d+", line)]
        assert numbers and numbers[0] > 0 and min(numbers) >= 0, line
