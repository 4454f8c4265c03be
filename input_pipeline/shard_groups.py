"""One group of documents -> its own shards and a `done.json` manifest; finished groups -> one
dataset. A group is written in its own folder and marked finished last, so a killed prepare
re-runs only unfinished groups, and hosts (`--num-parts`) never write the same file.

The held-out split is chosen per document by content (`is_eval_document`). A corpus with no
held-out document at all still gets one: the last training document of the last group that has
a next-token pair (an empty one would make an empty eval split), which that group keeps aside
(`fallback`) until the merge knows whether any group found one.

A null text (document `None`) is skipped; each group counts its own (`null_texts` in `done.json`)
and the merge adds them up, so the count is the same however the groups were written.

`done.json` also holds each shard's inode, size and modification time from before it was hashed
(`WRITTEN`); the merge records a shard's `shared_stamp` at its final name for the trainer's
shard check (`PreparedShards`) only where these are still the same: the move to that name
changes only its change time. A group finished by a version without them gets no record: its
shards are hashed at the first start, as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from input_pipeline.atomic import write_json
from input_pipeline.documents import Piece, piece_documents
from input_pipeline.errors import DataError
from input_pipeline.records import WRITTEN, Codec, ShardSet, arrayrecord_codec, split_long
from input_pipeline.tokenizers import ByteTokenizer, Tokenizer, tokenizer_from_file
from input_pipeline.verified import Stamp, shared_stamp

DONE_FILE = "done.json"
ENCODE_BATCH = 256  # documents per tokenizer call
SPLITS = ("train", "eval")
EXTENSIONS = {"arrayrecord": ".arrayrecord", "tfrecord": ".tfrecord"}


@dataclass(frozen=True)
class Recipe:
    """What every group of one prepare shares: equal recipes over equal inputs give equal data."""

    format: str
    eval_fraction: float
    explicit_eval: bool  # --eval-input: each piece's split is its file's, not its content's
    num_shards: int  # per group and split
    max_record_tokens: int
    token_dtype: str
    text_field: str = "text"
    tokenizer_file: str | None = None  # a SentencePiece model or tokenizer.json; None: bytes

    def tokenizer(self, threads: int | None = None) -> Tokenizer:
        if self.tokenizer_file is None:
            return ByteTokenizer()
        return tokenizer_from_file(self.tokenizer_file, threads)

    def codec(self) -> Codec:
        if self.format == "tfrecord":
            from input_pipeline.tfrecords import tfrecord_codec

            return tfrecord_codec(np.dtype(self.token_dtype))
        return arrayrecord_codec(np.dtype(self.token_dtype))

    def is_eval(self, text: str) -> bool:
        return is_eval_document(text, self.eval_fraction)


def is_eval_document(text: str, eval_fraction: float) -> bool:
    """Deterministic by content: the same corpus always gives the same held-out split."""
    digest = hashlib.sha256(text.encode("utf-8", errors="replace")).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < eval_fraction


Source = tuple[Iterable[str | None], str | None]  # documents (None: a null text), their split


def piece_sources(pieces: list[Piece], recipe: Recipe) -> list[Source]:
    """A file group's documents, each piece with its split: held-out files are all eval, and
    with held-out files given every other file is all train."""
    forced = "train" if recipe.explicit_eval else None
    return [
        (piece_documents(p, recipe.text_field), "eval" if p["eval"] else forced) for p in pieces
    ]


class _GroupWriter:
    """Documents -> tokenized records -> round-robin shards, a batch of documents at a time."""

    def __init__(self, folder: Path, recipe: Recipe, tok: Tokenizer, last_group: bool):
        self.recipe, self.tok = recipe, tok
        codec = recipe.codec()
        self.shards = {s: ShardSet(folder, s, recipe.num_shards, codec) for s in SPLITS}
        self.fallback = ShardSet(folder, "fallback", 1, codec)
        self.documents = dict.fromkeys(SPLITS, 0)
        self.null_texts = 0  # documents skipped for a null text
        self.pending: dict[str, list[str]] = {s: [] for s in SPLITS}
        self.hold_last = last_group and recipe.eval_fraction > 0 and not recipe.explicit_eval
        # the records of the last training document that has any, written last: the fallback
        # eval document's candidate (an empty or one-token document would make an empty eval)
        self.held: list[np.ndarray] | None = None

    def add(self, text: str | None, split: str | None) -> None:
        """One document into `split` (None: chosen by its content); a null text is counted."""
        if text is None:
            self.null_texts += 1
            return
        if not isinstance(text, str):  # only a library caller's documents can be other things
            raise DataError(
                f"a document is {type(text).__name__}, not text; pass str documents (a None "
                "one is skipped and counted)"
            )
        split = split or ("eval" if self.recipe.is_eval(text) else "train")
        self.pending[split].append(text)
        self.documents[split] += 1
        if len(self.pending[split]) >= ENCODE_BATCH:
            self._flush(split)

    def _records(self, tokens: np.ndarray) -> list[np.ndarray]:
        """A document's records: at least one next-token pair each, long documents cut."""
        return [p for p in split_long(tokens, self.recipe.max_record_tokens) if len(p) > 1]

    def _flush(self, split: str) -> None:
        texts, self.pending[split] = self.pending[split], []
        for tokens in self.tok.encode_batch(texts) if texts else []:
            records = self._records(tokens)
            if self.hold_last and split == "train" and records:  # the new candidate
                self._write(split, self.held or [])
                self.held = records
            else:
                self._write(split, records)

    def _write(self, split: str, records: list[np.ndarray]) -> None:
        for record in records:
            self.shards[split].write(record)

    def finish(self) -> dict[str, Any]:
        self._flush("eval")
        self._flush("train")
        aside = False  # the last training document kept aside as the corpus's fallback eval
        if self.held is not None:
            aside = not self.documents["eval"]  # a group with a held-out document needs none
            target = self.fallback if aside else self.shards["train"]
            self.documents["train"] -= aside
            for record in self.held:
                target.write(record)
        manifest: dict[str, Any] = {
            "splits": {s: _split_entry(self.documents[s], self.shards[s].close()) for s in SPLITS},
            "null_texts": self.null_texts,
        }
        fallback = self.fallback.close()
        if aside:
            manifest["fallback"] = _split_entry(1, fallback)
        return manifest


def _split_entry(documents: int, shards: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "documents": documents,
        "records": sum(s["records"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "shards": shards,
    }


def write_group(
    folder: Path,
    sources: list[Source],
    recipe: Recipe,
    tok: Tokenizer,
    *,
    last_group: bool,
    on_document: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write one group from scratch into `folder`; `done.json`, written last, marks it finished."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    writer = _GroupWriter(folder, recipe, tok, last_group)
    for documents, split in sources:
        for text in documents:
            writer.add(text, split)
            if on_document is not None:
                on_document()
    manifest = writer.finish()
    write_json(folder / DONE_FILE, manifest)
    return manifest


def group_folder(staging: Path, index: int) -> Path:
    return staging / f"group-{index:05d}"


def finished(staging: Path, index: int) -> dict[str, Any] | None:
    """The manifest of a finished group, or None."""
    try:
        return json.loads((group_folder(staging, index) / DONE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def prepare_file_group(
    staging: str, index: int, pieces: list[Piece], recipe: dict[str, Any], last: bool, threads: int
) -> int:
    """A pool worker's task (spawn-safe: plain arguments): one group of input files; returns its
    input bytes, for the progress bar."""
    rec = Recipe(**recipe)
    write_group(
        group_folder(Path(staging), index),
        piece_sources(pieces, rec),
        rec,
        rec.tokenizer(threads),
        last_group=last,
    )
    release_freed_memory()
    return sum(p["end"] - p["start"] for p in pieces)


def release_freed_memory() -> None:
    """Give the heap pages a finished group freed back to the OS, so a process that writes group
    after group stays at one group's memory. glibc otherwise keeps them: after the first 16 MB
    ArrayRecord file buffer is freed it serves the next ones from its heap, where they fragment
    it, and a prepare grew by about 1 MB a group (issue 29). A no-op off glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc (macOS, musl, Windows)
        return
    trim(0)


def run_file_group(task: tuple) -> int:
    """`prepare_file_group` for `Pool.imap`, which passes one argument."""
    return prepare_file_group(*task)


def merge_groups(
    staging: Path, count: int, recipe: Recipe
) -> tuple[dict[str, Any], int, dict[str, tuple[Stamp, str]]]:
    """Move every group's shards to their global names in `staging`; return the `splits` entry
    of `dataset.json`, the number of null texts skipped, and the stamp and sha256 of each shard
    unchanged since it was hashed (`final_stamp`), by name. Safe to re-run after a kill: moved
    files are found moved."""
    manifests = [finished(staging, i) for i in range(count)]
    missing = [i for i, m in enumerate(manifests) if m is None]
    if missing:
        raise RuntimeError(f"groups {missing} are not finished")
    placed: dict[str, list[tuple[int, dict[str, Any]]]] = {s: [] for s in SPLITS}
    documents = dict.fromkeys(SPLITS, 0)
    for i, manifest in enumerate(manifests):
        for split in SPLITS:
            documents[split] += manifest["splits"][split]["documents"]
            placed[split] += [(i, shard) for shard in manifest["splits"][split]["shards"]]
    fallback = manifests[-1].get("fallback") if manifests else None
    if fallback:
        # the old rule of a tiny corpus: no held-out document anywhere -> the last train one
        split = "eval" if documents["eval"] == 0 and documents["train"] >= 1 else "train"
        documents[split] += 1
        placed[split] += [(count - 1, shard) for shard in fallback["shards"]]
    extension = EXTENSIONS[recipe.format]
    splits, stamps = {}, {}
    for split in SPLITS:
        if not documents[split]:
            continue
        shards = []
        for k, (group, shard) in enumerate(placed[split]):
            name = f"{split}-{k:05d}-of-{len(placed[split]):05d}{extension}"
            source = group_folder(staging, group) / shard["file"]
            if source.exists() or not (staging / name).exists():
                os.replace(source, staging / name)
            shard = {**shard, "file": name}
            stamp = final_stamp(staging / name, shard.pop(WRITTEN, None))
            if stamp is not None:
                stamps[name] = (stamp, shard["sha256"])
            shards.append(shard)
        splits[split] = _split_entry(documents[split], shards)
    # a group finished by a version that did not count null texts has none listed
    return splits, sum(manifest.get("null_texts", 0) for manifest in manifests), stamps


def final_stamp(shard: Path, written: list[int] | None) -> Stamp | None:
    """The `shared_stamp` of `shard` at its final name, after its last rename (which changes its
    change time), where its inode, size and modification time are still those it had when it
    was hashed (`written`); else None, and the trainer hashes it."""
    stamp = shared_stamp(shard)
    return stamp if written is not None and list(stamp[:3]) == written else None
