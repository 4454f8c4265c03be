"""Input files as a stream of documents, cut into deterministic groups of pieces.

`.txt` (and `.py`, `.md`, no suffix) files are one document each; `.jsonl` files hold one document
per line in a `text_field`; `.parquet` files one per row of a `text_field` column (suffixes in any
case). A group is a run of pieces of about `group_bytes` of input: whole files, or byte ranges of
a large `.jsonl` file (a line belongs to the range holding its first byte). Groups are the unit a
prepare resumes and splits between hosts, and depend only on the sorted file list, so every host
plans the same.

A null text (a parquet null, a JSONL `null`) is a document `None`: the writer skips and counts it,
so both formats follow one rule and prepare can say how many it left out.
"""

from __future__ import annotations

import codecs
import glob
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from input_pipeline.errors import DataError

TEXT_SUFFIXES = (".txt", ".py", ".md", "")
Piece = dict[str, Any]  # {"file", "start", "end", "eval"}: a byte range of one input file
LINE_COUNT_CHUNK = 16 * 2**20  # bytes read at a time to number the line of an error
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # JSON's \ud800-\udfff: maybe unpaired


def input_files(patterns: list[str], flag: str = "--input") -> list[Path]:
    """The sorted files the globs match, each once however many globs or spellings name it; a
    one-line error when they match none, or one that cannot be read."""
    matches = {f for pattern in patterns for f in glob.glob(pattern, recursive=True)}
    files = sorted(f for f in matches if not Path(f).is_dir())  # a folder holds no text itself
    if not files:
        folders = f" (only the folders {', '.join(sorted(matches))})" if matches else ""
        raise DataError(
            f"{flag} {' '.join(patterns)} matches no file{folders}; check the path or quoting, "
            "and name files, e.g. 'corpus/*.txt' or 'corpus/**/*.jsonl'"
        )
    unique: dict[Path, Path] = {}  # by the file itself: `a.txt` and `./a.txt` are one file
    for name in files:
        path = Path(name)
        _check_readable(path, flag)
        if input_kind(path) is None:
            raise DataError(_unsupported(path, flag))
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def check_disjoint(files: list[Path], eval_files: list[Path]) -> None:
    """Refuse a file named by both --input and --eval-input: its documents would be trained on
    and then evaluated, an eval that measures memory."""
    held_out = {f.resolve() for f in eval_files}
    both = [str(f) for f in files if f.resolve() in held_out]
    if both:
        raise DataError(
            f"{', '.join(both[:3])}{', ...' if len(both) > 3 else ''} matched both --input and "
            "--eval-input, so it would be trained on and evaluated; narrow the --input globs "
            "to leave the held-out files out"
        )


def _check_readable(path: Path, flag: str) -> None:
    """A one-line error for a matched name that cannot be read (a broken link, no read
    permission), before any work: a stat and an access check, no open."""
    if not path.exists():
        problem = f"a broken link (to {os.readlink(path)})" if path.is_symlink() else "gone"
    elif not os.access(path, os.R_OK):
        problem = "not readable by this user (permission denied)"
    else:
        return
    raise DataError(f"{path} is {problem}; fix it or leave it out of the {flag} globs")


def input_kind(path: Path) -> str | None:
    """How a file is read, by its suffix in any case (`.TXT` is a text file): "jsonl",
    "parquet" or "text"; None for a type prepare does not read."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".parquet"):
        return suffix[1:]
    return "text" if suffix in TEXT_SUFFIXES else None


def _unsupported(path: Path, flag: str) -> str:
    """The one line refusing a file type, with the conversion it needs where there is one."""
    suffix = path.suffix.lower()
    fix = {
        ".gz": f"decompress it first (gunzip -k {path})",
        ".json": f"write one JSON object per line to a .jsonl file (e.g. jq -c '.[]' {path})",
        ".csv": "convert it to .parquet or .jsonl with its text in one column or field",
    }.get(suffix, "rename it to .txt if it is text (one document a file), or convert it to .jsonl")
    return f"{path}: unsupported input type {path.suffix}; {fix}, or leave it out of {flag}"


def plan_groups(files: list[Path], eval_files: list[Path], group_bytes: int) -> list[list[Piece]]:
    """Training files then held-out files, cut into groups of about `group_bytes` each."""
    groups: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for path, is_eval in [(f, False) for f in files] + [(f, True) for f in eval_files]:
        total = path.stat().st_size
        step = max(1, group_bytes) if input_kind(path) == "jsonl" else max(total, 1)
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


def piece_documents(piece: Piece, text_field: str = "text") -> Iterator[str | None]:
    """The documents of one piece, read lazily; `None` for a null text."""
    path = Path(piece["file"])
    if input_kind(path) == "jsonl":
        return _jsonl_texts(path, piece["start"], piece["end"], text_field)
    if input_kind(path) == "parquet":
        return _parquet_texts(path, text_field)
    return iter([_utf8_text(path)])


def _utf8_text(path: Path) -> str:
    """A text file's one document; bytes that are not UTF-8 are refused, never replaced, so a
    binary or Latin-1 file cannot turn into replacement characters unnoticed. A leading UTF-8
    byte-order mark (Windows tools write one) marks the encoding and is no part of the text."""
    data = path.read_bytes()
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(_not_utf8(path, bom + err.start)) from None


def _not_utf8(where: Path | str, byte: int) -> str:
    return (
        f"{where} is not UTF-8 text (byte {byte:,}); convert it (e.g. iconv -f latin1 -t utf-8) "
        "or leave it out of --input"
    )


def _jsonl_texts(path: Path, start: int, end: int, text_field: str) -> Iterator[str | None]:
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
            if where == 0 and line.startswith(codecs.BOM_UTF8):  # a byte-order mark, not JSON
                where, line = len(codecs.BOM_UTF8), line[len(codecs.BOM_UTF8) :]
            if not line.strip():
                continue
            yield _jsonl_text(path, where, line, text_field)


def _jsonl_text(path: Path, where: int, line: bytes, text_field: str) -> str | None:
    """The text of one JSONL line (`None` for `null`), or a one-line error naming that line by
    its number and byte and saying what is wrong with it."""
    try:
        value = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        line_number = _line_number(path, where)
        raise DataError(_not_utf8(f"{path} line {line_number:,}", where + err.start)) from None
    except json.JSONDecodeError as err:
        raise DataError(
            f"{_line(path, where)} is not valid JSON ({err.msg}); fix or remove that line"
        ) from None
    if not isinstance(value, dict):
        raise DataError(
            f"{_line(path, where)} is a JSON {_json_type(value)}, not an object; each line "
            f'must be one object such as {{{json.dumps(text_field)}: "..."}}: fix or remove it'
        )
    if text_field not in value:
        fields = ", ".join(repr(k) for k in list(value)[:5]) or "none"
        raise DataError(
            f"{_line(path, where)} has no {text_field!r} field (its fields: {fields}); name the "
            "text field with --text-field, or fix that line"
        )
    text = value[text_field]
    if text is not None and not isinstance(text, str):
        raise DataError(
            f"{_line(path, where)}: field {text_field!r} holds {type(text).__name__}, not "
            "text; name the text field with --text-field, or fix that line"
        )
    if text is not None and SURROGATE_ESCAPE.search(line) and not _is_unicode(text):
        raise DataError(
            f"{_line(path, where)}: field {text_field!r} holds an unpaired surrogate escape "
            "(\\ud800-\\udfff), which is not text; fix or remove that line"
        )
    return text


def _line(path: Path, where: int) -> str:
    """`FILE line N (byte B)` for the line starting at byte `where`."""
    return f"{path} line {_line_number(path, where):,} (byte {where:,})"


def _line_number(path: Path, where: int) -> int:
    """The number of the line starting at byte `where`, which an editor or `sed -n Np` goes to:
    counted only for an error, so no read of the corpus pays for it."""
    newlines = 0
    with open(path, "rb") as f:
        while f.tell() < where:
            chunk = f.read(min(LINE_COUNT_CHUNK, where - f.tell()))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
    return newlines + 1


def _json_type(value: Any) -> str:
    """JSON's name for a decoded value's type: an array, a number, a string, ..."""
    if isinstance(value, list):
        return "array"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return "number" if isinstance(value, int | float) else "string"


def _is_unicode(text: str) -> bool:
    """False for a string with a lone surrogate, which JSON can escape but UTF-8 cannot hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parquet_texts(path: Path, text_field: str) -> Iterator[str | None]:
    """The text column, read a row group at a time so a large file never sits in memory; a null
    row is `None`, for the writer to count."""
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own ArrowInvalid / OSError family
        raise DataError(_unreadable_parquet(path, err)) from None
    columns = table.schema_arrow.names
    if text_field not in columns:
        raise DataError(
            f"{path} has no column {text_field!r} (columns: {', '.join(columns)}); name the "
            "text column with --text-field"
        )
    kind = table.schema_arrow.field(text_field).type
    if not _is_text_type(kind):
        raise DataError(
            f"{path} column {text_field!r} holds {kind}, not text; name the text column with "
            "--text-field"
        )
    batches = table.iter_batches(columns=[text_field])
    while True:
        try:  # a damaged row group is found only when read
            batch = next(batches, None)
            texts = [] if batch is None else batch.column(0).to_pylist()
        except Exception as err:  # ArrowInvalid, OSError ("Unexpected end of stream"), ...
            raise DataError(_unreadable_parquet(path, err)) from None
        if batch is None:
            return
        yield from texts


def _unreadable_parquet(path: Path, err: Exception) -> str:
    reason = (str(err).splitlines() or ["unreadable"])[0][:160]
    return (
        f"{path} is not a readable parquet file ({reason}); re-write or re-download it, or leave "
        "it out of --input"
    )


def _is_text_type(kind: Any) -> bool:
    """Arrow's text types: string, large_string, string_view, and each dictionary-encoded (what a
    pandas categorical column becomes); `to_pylist` gives `str` (or `None`) for all of them."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)


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
        documents = (t for t in piece_documents(piece, text_field) if t is not None and is_train(t))
        yield from nonblank_lines(documents, per_piece)
