"""What the benchmark scripts share at their command line: a user's mistake (a missing config, a
wrong key, a count of zero) is one line and exit code 2, as with `python -m trainer.main`, never
a traceback; and the repository's own files are found from any working directory."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from trainer.errors import USER_ERRORS

USAGE_EXIT = 2
REPO_ROOT = Path(__file__).resolve().parents[1]


def repo_file(relative: str) -> str:
    """A file of the repository (e.g. `configs/demo.yaml`): as written when run from the root,
    as BENCHMARKS.md does, else its absolute path."""
    anchored = REPO_ROOT / relative
    return relative if Path(relative).resolve() == anchored.resolve() else str(anchored)


def positive_int(text: str) -> int:
    """An argparse type for a count of steps, rounds or batches: one at least."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a whole number >= 1")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type for a count where 0 means a default (e.g. prepare's workers)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a whole number >= 0")
    return value


def run_main(main: Callable[[], int | None]) -> int:
    """Call a script's `main`; a user's mistake becomes `error: <line>` and exit code 2."""
    try:
        return main() or 0
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT
