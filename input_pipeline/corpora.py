"""Built-in corpora, prepared on first use into a cache folder and reused afterwards.

`python-stdlib`: every `.py` file of the running Python's standard library — a real corpus of
tens of MB that every Python install has, so the demo needs no download.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from input_pipeline.dataset_info import INFO_FILE
from input_pipeline.errors import DataError
from input_pipeline.prepare import prepare_dataset


def python_stdlib_documents() -> list[str]:
    """Sorted, so every machine with the same Python gets the same corpus and split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


BUILTIN_CORPORA: dict[str, Callable[[], list[str]]] = {"python-stdlib": python_stdlib_documents}


def default_cache_dir() -> Path:
    env = os.environ.get("ACCEL_TRAINER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "accel_trainer" / "datasets"


def builtin_dataset_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(cache_dir or default_cache_dir()) / f"{name}-byte-{version}"


def resolve_dataset(path: str, cache_dir: str | Path | None = None) -> Path:
    """A prepared dataset folder, or a built-in corpus name (prepared here on first use)."""
    if path in BUILTIN_CORPORA:
        folder = builtin_dataset_dir(path, cache_dir)
        if not (folder / INFO_FILE).exists():
            print(
                f"preparing built-in corpus {path!r} into {folder} (first use only)",
                file=sys.stderr,
            )
            prepare_dataset(BUILTIN_CORPORA[path](), folder, eval_fraction=0.01)
        return folder
    folder = Path(path)
    if not folder.exists():
        raise DataError(
            f"data.path={path} does not exist; give a folder made by python -m "
            f"input_pipeline.prepare or a built-in corpus ({', '.join(BUILTIN_CORPORA)})"
        )
    return folder
