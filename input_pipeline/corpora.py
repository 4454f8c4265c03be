"""Built-in corpora, prepared on first use into a cache folder and reused afterwards.

Both come from the running Python's standard library, so nothing is downloaded: `python-stdlib`
(every `.py` file, about 30 MB of code) and `python-docstrings` (its docstrings, 1.8 MB of
English, for character-level recipes such as nanoGPT's).
"""

from __future__ import annotations

import ast
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from input_pipeline.dataset_info import INFO_FILE
from input_pipeline.errors import DataError
from input_pipeline.prepare import prepare_dataset


def _stdlib_files(skip: tuple[str, ...] = ("site-packages",)) -> list[Path]:
    """Sorted, so every machine with the same Python gets the same corpus and split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not set(skip) & set(p.parts))


def python_stdlib_documents() -> list[str]:
    """Every standard-library source file, one document each (about 30 MB of code)."""
    return [p.read_text(encoding="utf-8", errors="replace") for p in _stdlib_files()]


def python_docstring_documents() -> list[str]:
    """The docstrings of the standard library (tests excluded), one document per module: about
    1.8 MB of English prose, a character-level corpus the size of tiny-shakespeare."""
    documents = []
    for path in _stdlib_files(skip=("site-packages", "test", "tests", "idle_test")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue  # a few stdlib files are deliberately invalid (lib2to3 test data)
        owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        texts = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, owners)]
        texts = [t for t in texts if t]
        if texts:
            documents.append("\n\n".join(texts))
    return documents


@dataclass(frozen=True)
class Corpus:
    documents: Callable[[], list[str]]
    eval_fraction: float


BUILTIN_CORPORA: dict[str, Corpus] = {
    "python-stdlib": Corpus(python_stdlib_documents, eval_fraction=0.01),
    "python-docstrings": Corpus(python_docstring_documents, eval_fraction=0.1),
}


def default_cache_dir() -> Path:
    env = os.environ.get("ACCEL_TRAINER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "accel_trainer" / "datasets"


def builtin_dataset_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(cache_dir or default_cache_dir()) / f"{name}-byte-{version}"


def resolve_dataset(path: str, cache_dir: str | Path | None = None, key: str = "data.path") -> Path:
    """A prepared dataset folder, or a built-in corpus name (prepared here on first use); `key`
    is the config key that named it, for the error."""
    if path in BUILTIN_CORPORA:
        folder = builtin_dataset_dir(path, cache_dir)
        if not (folder / INFO_FILE).exists():
            print(
                f"preparing built-in corpus {path!r} into {folder} (first use only)",
                file=sys.stderr,
            )
            corpus = BUILTIN_CORPORA[path]
            prepare_dataset(corpus.documents(), folder, eval_fraction=corpus.eval_fraction)
        return folder
    folder = Path(path)
    if not folder.exists():
        raise DataError(
            f"{key}={path} does not exist; give a folder made by python -m "
            f"input_pipeline.prepare or a built-in corpus ({', '.join(BUILTIN_CORPORA)})"
        )
    if not folder.is_dir():
        raise DataError(
            f"{key}={path} is a file; give the dataset folder that holds it ({folder.parent})"
        )
    return folder
