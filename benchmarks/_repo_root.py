"""Imported first by every benchmark script: run as `python benchmarks/X.py`, this folder heads
`sys.path`, and `benchmarks/input_pipeline.py` would then shadow the `input_pipeline` package
for everything imported after it. Put the repository root there instead."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:
    sys.path[0] = str(_HERE.parent)
