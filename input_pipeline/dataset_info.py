"""`dataset.json`: what a prepared dataset holds (tokenizer, dtype, splits, shard checksums, and
how many input documents prepare skipped for a null text)."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from input_pipeline.errors import DataError
from input_pipeline.verified import (
    PreparedShards,
    Stamp,
    VerifiedShards,
    check_line,
    shards_to_hash,
    shared_stamp,
)

INFO_FILE = "dataset.json"
NULL_TEXTS = "null_texts_skipped"  # present only when prepare skipped some


@dataclass(frozen=True)
class DatasetInfo:
    path: Path
    raw: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.raw["vocab_size"])

    @property
    def token_dtype(self) -> str:
        return self.raw["token_dtype"]

    @property
    def format(self) -> str:
        return self.raw.get("format", "arrayrecord")

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.raw["tokenizer"]

    @property
    def fingerprint(self) -> str:
        """Short content hash: a checkpoint remembers which dataset it was trained on."""
        text = json.dumps(self.raw, sort_keys=True).encode()
        return hashlib.sha256(text).hexdigest()[:16]

    def split(self, name: str) -> dict[str, Any]:
        splits = self.raw.get("splits", {})
        if name not in splits:
            raise DataError(
                f"dataset {self.path} has no {name!r} split (has: {', '.join(splits)}); "
                "re-run python -m input_pipeline.prepare with --eval-fraction or --eval-input"
            )
        return splits[name]

    def shard_paths(self, name: str) -> list[Path]:
        paths = [self.path / shard["file"] for shard in self.split(name)["shards"]]
        for path in paths:
            if not path.is_file():
                raise DataError(
                    f"shard {path} listed in {self.path / INFO_FILE} is missing; restore it or "
                    "re-run python -m input_pipeline.prepare --overwrite"
                )
        return paths

    def checksums(self) -> list[tuple[Path, str | None]]:
        """Every shard of every split, with the sha256 `prepare` recorded (None: not recorded)."""
        return [
            (path, shard.get("sha256"))
            for name in self.raw.get("splits", {})
            for path, shard in zip(self.shard_paths(name), self.split(name)["shards"], strict=True)
        ]

    @cached_property
    def prepared(self) -> PreparedShards:
        """`prepare`'s record of the stamps its shards had once written, with their sha256."""
        return PreparedShards(self.path)

    def checked(
        self, path: Path, stamp: Stamp, sha256: str, verified: VerifiedShards | None
    ) -> bool:
        """Whether the shard at `path`, now `stamp`, is known to match `sha256` without reading
        it: `verified` (this process's record) or prepare's holds it so unchanged since. Without
        a record (`verified` None) every shard is read."""
        if verified is None:
            return False
        return verified.known(path, stamp, sha256) or self.prepared.vouches(path, stamp, sha256)

    def mismatch(self, path: Path) -> str:
        """What is said of the shard at `path` whose bytes do not match their sha256."""
        return (
            f"shard {path} does not match the checksum in {self.path / INFO_FILE} (changed or "
            "damaged since prepare); restore it or re-run python -m input_pipeline.prepare "
            "--overwrite (data.verify_checksums=false skips this)"
        )

    def unreadable(self, path: Path, err: OSError) -> str:
        """What is said of the shard at `path` that could not be read to check it."""
        return (
            f"cannot read shard {path} to check it ({err.strerror or err}); repair that storage "
            "or restore the shard (data.verify_checksums=false skips this)"
        )

    def verify_checksums(self, verified: VerifiedShards | None = None) -> None:
        """`verify_datasets` of this dataset alone."""
        verify_datasets([self], verified)

    def num_records(self, name: str) -> int:
        return int(self.split(name)["records"])

    def num_tokens(self, name: str) -> int:
        return int(self.split(name)["tokens"])


# What `records.token_dtype` writes, and how many token ids each can hold.
TOKEN_DTYPES = {"|u1": 2**8, "<u2": 2**16, "<u4": 2**32}
KINDS = {int: "whole number", str: "string", dict: "JSON object", list: "list"}


def check_fields(raw: Any, info_file: Path) -> None:
    """Every field a run reads, present and of its type: a damaged or hand-edited `dataset.json`
    fails here in one line naming the field, not as a KeyError deep in the pipeline."""
    if not isinstance(raw, dict):
        raise DataError(_bad_field(info_file, "the top level", raw, "JSON object"))
    _field(info_file, raw, "vocab_size", int)
    _field(info_file, _field(info_file, raw, "tokenizer", dict), "kind", str, "tokenizer.")
    if _field(info_file, raw, "token_dtype", str) not in TOKEN_DTYPES:
        raise DataError(_bad_field(info_file, "token_dtype", raw["token_dtype"], "|u1, <u2 or <u4"))
    ids = TOKEN_DTYPES[raw["token_dtype"]]
    if ids < raw["vocab_size"]:  # prepare could not have stored the ids past it
        raise DataError(
            f"{info_file}: token_dtype {raw['token_dtype']} holds ids below {ids}, not the "
            f"vocab_size of {raw['vocab_size']} (damaged, or edited since prepare); restore it "
            "or re-run python -m input_pipeline.prepare --overwrite"
        )
    if NULL_TEXTS in raw:  # optional: older datasets, and clean corpora, have none
        _field(info_file, raw, NULL_TEXTS, int)
    splits = _field(info_file, raw, "splits", dict)
    _field(info_file, splits, "train", dict, "splits.")
    for name in splits:
        where = f"splits.{name}."
        split = _field(info_file, splits, name, dict, "splits.")
        for count in ("documents", "records", "tokens"):
            _field(info_file, split, count, int, where)
        listed = 0
        for i, shard in enumerate(_field(info_file, split, "shards", list, where)):
            shard = _field(info_file, {i: shard}, i, dict, f"{where}shards")
            _field(info_file, shard, "file", str, f"{where}shards[{i}].")
            listed += _field(info_file, shard, "records", int, f"{where}shards[{i}].")
            if "sha256" in shard:
                _field(info_file, shard, "sha256", str, f"{where}shards[{i}].")
        if listed != split["records"]:  # else a reader meets fewer records than it counts on
            raise DataError(
                f"{info_file}: {where}records is {split['records']} but its shards list "
                f"{listed} (damaged, or not written by prepare); re-run python -m "
                "input_pipeline.prepare --overwrite"
            )
    check_every_checksum_listed(splits, info_file)


def check_every_checksum_listed(splits: dict[str, Any], info_file: Path) -> None:
    """A shard without a sha256 beside shards with one: prepare writes one for every shard, so
    that shard's checksum was lost, and with it the check that it is unchanged. (A listing
    without any sha256, written by hand for other data, has nothing to check.)"""
    shards = [
        (f"splits.{name}.shards[{i}]", shard)
        for name, split in splits.items()
        for i, shard in enumerate(split["shards"])
    ]
    without = [(where, shard["file"]) for where, shard in shards if not shard.get("sha256")]
    if without and len(without) < len(shards):
        where, file = without[0]
        raise DataError(
            f"{info_file}: {where} ({file}) has no sha256 while other shards have one (damaged, "
            "or edited since prepare), so that shard cannot be checked; restore it or re-run "
            "python -m input_pipeline.prepare --overwrite"
        )


def _field(info_file: Path, parent: dict, key: Any, kind: type, prefix: str = "") -> Any:
    value = parent.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        name = f"{prefix}[{key}]" if isinstance(key, int) else f"{prefix}{key}"
        raise DataError(_bad_field(info_file, name, value, KINDS[kind]))
    return value


def _bad_field(info_file: Path, name: str, value: Any, wanted: str) -> str:
    found = "missing" if value is None else f"{json.dumps(value)[:40]}"
    return (
        f"{info_file}: {name} is {found}, not a {wanted} (damaged, or not written by prepare); "
        "re-run python -m input_pipeline.prepare --overwrite"
    )


Gather = Callable[[np.ndarray], np.ndarray]  # every process's int64 array, one row each
# What a process found of each shard it was to hash (`verify_datasets`).
NOT_HASHED, MATCHES, DIFFERS, UNREADABLE = range(4)


def alone(mine: np.ndarray) -> np.ndarray:
    """The `Gather` of a process that checks alone: its own row, and no collective call."""
    return mine[None]


def verify_datasets(
    datasets: Sequence[DatasetInfo],
    verified: VerifiedShards | None = None,
    *,
    me: int = 0,
    gather: Gather = alone,
) -> int | None:
    """Compare every shard of `datasets` with the sha256 `prepare` recorded: a shard changed or
    damaged since then fails here, before training, rather than as odd batches later. Shards are
    hashed on parallel threads (hashlib releases the GIL), after one line on stderr saying what
    is read (`check_line`); those `verified` (this process's record) or prepare's holds
    unchanged since they matched are not read again, and those that match now are added to it,
    even when another does not.

    By default this process checks alone and makes no collective call: a library caller may
    call it on one process of many, at any time. With `gather` (an all-gather among the
    processes of a run, this one process `me`) they check together: each must then call it at
    the same point with the same datasets, and on shared storage each shard is read once among
    them (`shards_to_hash`); process 0 says the line for all. A shard that fails raises
    DataError on every process that sees it as one shared file, else on each process whose own
    copy failed; the others return the first process that failed (None: every shard passed)."""
    shards = [(info, path, sha) for info in datasets for path, sha in info.checksums() if sha]
    if not shards:  # a listing without any sha256 has nothing to check
        return None
    stamps = [_stamp(path) for _, path, _ in shards]
    mine_Sx5 = [
        [*stamp, not info.checked(path, stamp, sha, verified)]
        for (info, path, sha), stamp in zip(shards, stamps, strict=True)
    ]
    everyone_PxSx5 = gather(np.array(mine_Sx5, np.int64))
    stamps_PxSx4, unchecked_PxS = everyone_PxSx5[..., :4], everyone_PxSx5[..., 4] != 0
    if not unchecked_PxS.any():  # every process knows every shard: they all return here
        return None
    if me == 0:  # it has every process's stamps from the gather
        print(check_line(stamps_PxSx4, unchecked_PxS), file=sys.stderr)
    shared_S, mine = shards_to_hash(stamps_PxSx4, unchecked_PxS, me)
    with ThreadPoolExecutor() as pool:
        hashed = dict(zip(mine, pool.map(lambda s: _hash(*shards[s]), mine), strict=True))
    found_S = np.array([hashed.get(s, (NOT_HASHED,))[0] for s in range(len(shards))], np.int64)
    found_PxS = gather(found_S)
    matched_S = np.where(shared_S, (found_PxS == MATCHES).any(axis=0), found_PxS[me] == MATCHES)
    if verified is not None:
        for (_, path, sha), stamp, matched in zip(shards, stamps, matched_S, strict=True):
            if matched:
                verified.add(path, stamp, sha)
        verified.save()
    differs_shared = np.flatnonzero(shared_S & (found_PxS == DIFFERS).any(axis=0))
    if differs_shared.size:  # every process says it
        info, path, _ = shards[differs_shared[0]]
        raise DataError(info.mismatch(path))
    failed_PxS = found_PxS >= DIFFERS
    if failed_PxS[me].any():
        raise DataError(hashed[np.flatnonzero(failed_PxS[me])[0]][1])
    failed_P = np.flatnonzero(failed_PxS.any(axis=1))  # that process says why
    return int(failed_P[0]) if failed_P.size else None


def _stamp(path: Path) -> Stamp:
    """`shared_stamp` of a shard; none (-1s) for one gone since it was listed (which its hash
    then says)."""
    try:
        return shared_stamp(path)
    except OSError:
        return (-1, -1, -1, -1)


def _hash(info: DatasetInfo, path: Path, sha256: str) -> tuple[int, str]:
    """What hashing the shard at `path` finds, and the line saying what is wrong with it."""
    try:
        return (MATCHES if sha256_of(path) == sha256 else DIFFERS), info.mismatch(path)
    except OSError as err:
        return UNREADABLE, info.unreadable(path, err)


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read block by block."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_dataset_info(path: str | Path) -> DatasetInfo:
    """Read and sanity-check a prepared dataset folder."""
    path = Path(path)
    info_file = path / INFO_FILE
    if not info_file.is_file():
        raise DataError(
            f"{path} is not a prepared dataset (no {INFO_FILE}); run python -m "
            f"input_pipeline.prepare --input 'corpus/*.txt' --output {path}, or use a built-in "
            "corpus name such as python-stdlib"
        )
    try:
        raw = json.loads(info_file.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{info_file} is not valid JSON ({err.msg}); re-run prepare") from None
    check_fields(raw, info_file)
    info = DatasetInfo(path=path, raw=raw)
    if info.num_records("train") == 0:
        raise DataError(f"dataset {path} has an empty train split; prepare it from more text")
    if "eval" in raw["splits"] and info.num_records("eval") == 0:
        raise DataError(
            f"dataset {path} has an eval split without tokens, which no eval can average; "
            "re-run python -m input_pipeline.prepare --overwrite with longer held-out text"
        )
    return info
