"""The benchmark scripts start the way BENCHMARKS.md runs them (`python benchmarks/X.py`): a
script whose folder shadows a package (benchmarks/input_pipeline.py vs `input_pipeline`) once
broke every other benchmark at import."""

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
