"""Input files as a stream of documents, cut into deterministic groups of pieces.

`.txt` (and `.py`, `.md`, no suffix) files are one document each; `.jsonl` files hold one document
per line in a `text_field`; `.parquet` files one per row of a `text_field` column. A group is a
run of pieces of about `group_bytes` of input: whole files, or byte ranges of a large `.jsonl`
file (a line belongs to the range holding its first byte). Groups are the unit a prepare resumes
and splits between hosts, and depend only on the sorted file list, so every host plans the same.
"""

from __future__ import annotations

import glob
import itertools
import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from input_pipeline.errors import DataError

TEXT_SUFFIXES = (".txt", ".py", ".md", "")
Piece = dict[str, Any]  # {"file", "start", "end", "eval"}: a byte range of one input file


def input_files(patterns: list[str], flag: str = "--input") -> list[Path]:
    """The sorted files the globs match; a one-line error when they match none."""
    files = sorted({f for pattern in patterns for f in glob.glob(pattern, recursive=True)})
    if not files:
        raise DataError(f"{flag} {' '.join(patterns)} matches no file; check the path or quoting")
    for name in files:
        suffix = Path(name).suffix
        if suffix not in (".jsonl", ".parquet", *TEXT_SUFFIXES):
            raise DataError(
                f"{name}: unsupported input type {suffix}; use .txt, .jsonl or .parquet"
            )
    return [Path(f) for f in files]


def plan_groups(files: list[Path], eval_files: list[Path], group_bytes: int) -> list[list[Piece]]:
    """Training files then held-out files, cut into groups of about `group_bytes` each."""
    groups: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for path, is_eval in [(f, False) for f in files] + [(f, True) for f in eval_files]:
        total = path.stat().st_size
        step = max(1, group_bytes) if path.suffix == ".jsonl" else max(total, 1)
        for start in range(0, max(total, 1), step):
            end = min(start + step, total)
            current.append({"file": str(path), "start": start, "end": end, "eval": is_eval})
            size += end - start
            if size >= group_bytes:
                groups.append(current)
                current, size = [], 0
    if current:
        groups.append(current)
    return groups


def piece_documents(piece: Piece, text_field: str = "text") -> Iterator[str]:
    """The documents of one piece, read lazily."""
    path = Path(piece["file"])
    if path.suffix == ".jsonl":
        return _jsonl_texts(path, piece["start"], piece["end"], text_field)
    if path.suffix == ".parquet":
        return _parquet_texts(path, text_field)
    return iter([path.read_text(encoding="utf-8", errors="replace")])


def _jsonl_texts(path: Path, start: int, end: int, text_field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line holding byte start-1 belongs to the previous range
        position = f.tell()
        while position < end:
            line = f.readline()
            if not line:
                break
            where, position = position, position + len(line)
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_field]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                raise DataError(
                    f"{path} (byte {where}) is not a JSON object with a {text_field!r} field; "
                    "name the field with --text-field"
                ) from None
            yield text


def _parquet_texts(path: Path, text_field: str) -> Iterator[str]:
    """The text column, read a row group at a time so a large file never sits in memory."""
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own ArrowInvalid / OSError family
        raise DataError(f"{path} is not a readable parquet file ({err})") from None
    columns = table.schema_arrow.names
    if text_field not in columns:
        raise DataError(
            f"{path} has no column {text_field!r} (columns: {', '.join(columns)}); name the "
            "text column with --text-field"
        )
    for batch in table.iter_batches(columns=[text_field]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def nonblank_lines(documents: Iterable[str], limit: int) -> Iterator[str]:
    """The first `limit` non-blank lines: SentencePiece learns from lines, blanks teach nothing."""
    lines = (line for document in documents for line in document.splitlines() if line.strip())
    return itertools.islice(lines, limit)


def sample_lines(
    pieces: list[Piece], sentences: int, text_field: str, is_train: Callable[[str], bool]
) -> Iterator[str]:
    """A bounded, deterministic tokenizer-training sample: the first `sentences / pieces` lines
    of the training documents (`is_train(text)`) of every training piece, so the sample spans
    the corpus while reading only a prefix of each piece."""
    train = [p for p in pieces if not p["eval"]]
    per_piece = math.ceil(sentences / max(1, len(train)))
    for piece in train:
        documents = (t for t in piece_documents(piece, text_field) if is_train(t))
        yield from nonblank_lines(documents, per_piece)
