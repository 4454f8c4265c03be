"""Tokenized records in ArrayRecord shards: one record is one document's (or one bounded piece
of a long document's) tokens as raw little-endian integers of the dataset's token dtype."""

from __future__ import annotations

import glob
import json
import os
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from input_pipeline.dataset_info import INFO_FILE, sha256_of
from input_pipeline.errors import DataError, damaged_shard
from input_pipeline.verified import shared_stamp

# group_size:1 keeps every record independently addressable: global shuffles stay cheap.
WRITER_OPTIONS = "group_size:1"
READER_OPTIONS = "readahead_buffer_size:0"  # random access: what Grain's own reader uses
WRITTEN = "written"  # a shard's inode, size and mtime_ns before it was hashed: done.json only


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type the vocabulary fits: uint8 (byte-level), uint16, else uint32.
    Narrower records are fewer bytes to decompress per token (BENCHMARKS.md)."""
    for dtype in ("|u1", "<u2"):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    return np.dtype("<u4")


def split_long(tokens: np.ndarray, max_record_tokens: int) -> list[np.ndarray]:
    """Cut a long document into pieces so random access reads a bounded record."""
    return [tokens[i : i + max_record_tokens] for i in range(0, len(tokens), max_record_tokens)]


Codec = tuple[Callable[[str], Any], Callable[[np.ndarray], bytes]]  # open a shard; encode


def arrayrecord_codec(dtype: np.dtype) -> Codec:
    """How `ShardSet` opens an ArrayRecord shard and encodes a record (raw token bytes)."""
    return (
        lambda path: ArrayRecordWriter(path, WRITER_OPTIONS),
        lambda tokens: np.asarray(tokens, dtype=dtype).tobytes(),
    )


class ShardSet:
    """Records streamed round-robin over at most `num_shards` files `{prefix}-{i:05d}`, each
    opened when its first record arrives, so a small split gets no empty shard and memory does
    not grow with the data."""

    def __init__(
        self,
        folder: Path,
        prefix: str,
        num_shards: int,
        codec: Codec,
    ):
        self.folder, self.prefix, self.num_shards = folder, prefix, max(1, num_shards)
        self._open_writer, self._encode = codec
        self._writers: list[Any] = []
        self._counts: list[list[int]] = []  # records, tokens per shard
        self.records = 0

    def name(self, index: int) -> str:
        return f"{self.prefix}-{index:05d}"

    def write(self, tokens: np.ndarray) -> None:
        shard = self.records % self.num_shards
        if shard == len(self._writers):
            self._writers.append(self._open_writer(str(self.folder / self.name(shard))))
            self._counts.append([0, 0])
        self._writers[shard].write(self._encode(tokens))
        self._counts[shard][0] += 1
        self._counts[shard][1] += len(tokens)
        self.records += 1

    def close(self) -> list[dict[str, Any]]:
        """Close every file; per-shard counts, SHA-256 and the stamp it had before it was read
        for its SHA-256 (`WRITTEN`), in shard order."""
        for writer in self._writers:
            writer.close()
        return [self._listing(i, r, t) for i, (r, t) in enumerate(self._counts)]

    def _listing(self, index: int, records: int, tokens: int) -> dict[str, Any]:
        """Shard `index`'s entry, its stamp taken before its bytes are read for the SHA-256: a
        write after the stamp, during the read or after it, leaves the shard with another stamp,
        so prepare does not vouch for bytes it did not read and the trainer hashes them."""
        path = self.folder / self.name(index)
        written = list(shared_stamp(path)[:3])
        entry = {"file": path.name, "records": records, "tokens": tokens, WRITTEN: written}
        return {**entry, "sha256": sha256_of(path)}


class DecodeRecord(grain.transforms.Map):
    """Record bytes -> aligned next-token pairs, so packing never pairs tokens across documents.
    The pairs are views of the stored tokens (uint8, uint16 or uint32), not int32 copies: packing
    widens them as it copies them into the batch, so each token is copied once. `info_file`:
    the dataset.json whose `token_dtype` is `dtype`."""

    def __init__(self, dtype: str, info_file: Path | str = INFO_FILE):
        self.dtype = np.dtype(dtype)
        self.info_file = info_file

    def map(self, record: bytes) -> dict[str, np.ndarray]:
        if len(record) % self.dtype.itemsize:
            raise DataError(self._not_whole_tokens(len(record)))
        tokens = np.frombuffer(record, dtype=self.dtype)
        return {"inputs": tokens[:-1], "targets": tokens[1:]}

    def _not_whole_tokens(self, size: int) -> str:
        """ArrayRecord checks each record's bytes, so the token_dtype listed is the likely fault."""
        return (
            f"a record of {size} bytes is not a whole number of {self.dtype} tokens, the "
            f"token_dtype {self.info_file} lists ({self.dtype.str}): that token_dtype was edited "
            "since prepare, or a shard is damaged; restore that dataset.json or re-run python -m "
            "input_pipeline.prepare --overwrite"
        )


class CheckedSource:
    """Random access over a split's shards that turns ArrayRecord corruption into a `DataError`
    naming the shard — or, with `skip_corrupt`, yields `None` for records that cannot be read
    (a whole shard when even its index is unreadable); the pipeline filters those out. Custom:
    Grain's `ArrayRecordDataSource` neither names a damaged shard nor skips damaged records.

    Each skipped record is listed once in `skip_log` (`SkipLog`), and `SkippedCount` turns
    that file into the number the metrics show."""

    def __init__(
        self,
        paths: list[Path],
        records_per_shard: list[int],
        skip_corrupt: bool = False,
        skip_log: Path | None = None,
    ):
        self.paths = [str(p) for p in paths]
        self.skip_corrupt = skip_corrupt
        self.skip_log = str(skip_log) if skip_log else None
        self.starts = np.concatenate([[0], np.cumsum(records_per_shard)])
        self.shards = [
            self._open(path, listed)
            for path, listed in zip(self.paths, records_per_shard, strict=True)
        ]
        if self.shards and all(shard is None for shard in self.shards):
            raise DataError(
                f"all {len(self.paths)} shards of {Path(self.paths[0]).parent} this split reads "
                f"(first {Path(self.paths[0]).name}) are corrupt or truncated; "
                "data.skip_corrupt=true leaves nothing to read: restore them or re-run python -m "
                "input_pipeline.prepare --overwrite"
            )
        self._readers: list[ArrayRecordReader | None] = [None] * len(self.paths)  # read_many's
        self._lock = threading.Lock()
        self._skips = SkipLog(self.skip_log)

    def _open(self, path: str, listed: int):
        """The shard's reader; None where its index is unreadable and `skip_corrupt` is on. A
        shard holding other than the `listed` records (dataset.json's count) is not the one
        prepare wrote: records past its end would be a ValueError from inside array_record, records
        past the listed ones never read."""
        try:
            source = grain.sources.ArrayRecordDataSource([path])
        except RuntimeError as err:
            if self.skip_corrupt:
                return None
            raise DataError(_corrupt_message(path, err)) from None
        if len(source) != listed:
            raise DataError(
                f"shard {path} holds {len(source)} records but {Path(path).parent / INFO_FILE} "
                f"lists {listed} (the two do not belong together); restore them or re-run "
                "python -m input_pipeline.prepare --overwrite"
            )
        return source

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> bytes | None:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        source = self.shards[shard]
        try:
            if source is not None:
                return source[index - int(self.starts[shard])]
        except RuntimeError as err:
            if not self.skip_corrupt:
                raise DataError(_corrupt_message(self.paths[shard], err)) from None
        self._skips.add(int(index), {"shard": self.paths[shard], "record": int(index)})
        return None

    def read_many(self, indices: Sequence[int]) -> list[bytes | None]:
        """Records `indices`, in that order, with one batched read per shard: ArrayRecord then
        decompresses them on its own threads, outside the GIL. A shard whose batched read fails
        is read record by record, so damage is reported or skipped exactly as by `__getitem__`."""
        keys = np.asarray(indices, np.int64)
        shard_of = np.searchsorted(self.starts, keys, side="right") - 1
        records: list[bytes | None] = [None] * len(keys)
        for shard in np.unique(shard_of).tolist():
            where = np.flatnonzero(shard_of == shard).tolist()
            try:
                reader = self._reader(shard)
                found = reader.read((keys[where] - self.starts[shard]).tolist())
            except RuntimeError:
                found = [self[int(keys[i])] for i in where]
            for i, record in zip(where, found, strict=True):
                records[i] = record
        return records

    def _reader(self, shard: int) -> ArrayRecordReader:
        if self.shards[shard] is None:  # unreadable index, skip_corrupt: read record by record
            raise RuntimeError(f"{self.paths[shard]} has no readable index")
        with self._lock:  # reader threads share one reader per shard, as Grain's source does
            if self._readers[shard] is None:
                self._readers[shard] = ArrayRecordReader(
                    self.paths[shard], options=READER_OPTIONS, file_reader_buffer_size=32768
                )
            return self._readers[shard]

    def __getstate__(self) -> dict[str, Any]:  # worker processes open their own readers
        state = self.__dict__.copy()
        state["_readers"], state["_lock"] = [None] * len(self.paths), None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class SkipLog:
    """A reader's list of the records `data.skip_corrupt` skipped, appended to `path` as JSON
    lines for `SkippedCount`. Each record is written once per reader, not once per epoch, so the
    file stays as small as the damage; each shard's first skip is also said on stderr, since the
    metrics' count alone is easy to miss. Reader threads share one; a Grain worker process gets
    its own copy (its duplicates are harmless: the count dedups)."""

    def __init__(self, path: str | Path | None):
        self.path = None if path is None else str(path)
        self._logged: set[Hashable] = set()  # keys of the records listed: one per bad record met
        self._warned: set[str] = set()  # shards whose first skip was said on stderr
        self._lock = threading.Lock()

    def add(self, key: Hashable, entry: dict[str, Any]) -> None:
        """List one skipped record (`{"shard", "record"|"offset"}`) unless `key`, a compact name
        for it (a record index, or a shard and offset), was listed already."""
        if self.path is None:
            return
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
            first_of_shard = entry["shard"] not in self._warned
            self._warned.add(entry["shard"])
        append_line(self.path, json.dumps(entry))
        if first_of_shard:
            print(
                f"warning: skipping unreadable records of shard {entry['shard']} "
                f"(data.skip_corrupt=true); listed in {self.path}, counted as "
                "corrupt_records_skipped in the metrics",
                file=sys.stderr,
            )

    def __getstate__(self) -> dict[str, Any]:  # a worker process makes its own lock
        return {**self.__dict__, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def append_line(path: str, line: str) -> None:
    """One `write` on an append-mode file, so reader threads and worker processes can all append
    to the same file without interleaving."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:  # data.cache=memory reads the shards before the run's workdir exists
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, flags, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class SkippedCount:
    """Distinct records listed in a skip log so far, as a callable the metrics call at every
    line: each call reads only what was appended since the last (remembering the byte offset and
    the lines seen), so a long run does not re-read the whole log each time. Distinct, because
    Grain worker processes and data streams each read (and list) the same bad records again; a
    last line not yet ended by its newline is left for the next call. A log named
    `<name>.<process>.jsonl` counts with the other processes' logs beside it (`process_logs`):
    process 0 writes the metrics, and the run's count is every process's records."""

    def __init__(self, skip_log: str | Path):
        self.path = Path(skip_log)
        self._offsets: dict[Path, int] = {}  # bytes of whole lines read so far, per log
        self._lines: set[bytes] = set()

    def __call__(self) -> int:
        for path in process_logs(self.path):
            if not self._read_appended(path):  # one was replaced: count them all afresh
                self._offsets, self._lines = {}, set()
                for again in process_logs(self.path):
                    self._read_appended(again)
                break
        return len(self._lines)

    def _read_appended(self, path: Path) -> bool:
        """Add the whole lines appended to `path` since the last read; False if it shrank."""
        offset = self._offsets.get(path, 0)
        try:
            with path.open("rb") as log:
                if os.fstat(log.fileno()).st_size < offset:
                    return False
                log.seek(offset)
                appended = log.read()
        except FileNotFoundError:
            return True
        whole = appended.rfind(b"\n") + 1  # through the last complete line
        self._lines.update(line for line in appended[:whole].splitlines() if line.endswith(b"}"))
        self._offsets[path] = offset + whole
        return True


def process_logs(skip_log: Path) -> list[Path]:
    """`skip_log`, and where it is `<name>.<process>.jsonl` (`trainer.data.skip_log_path`) every
    process's `<name>.<n>.jsonl` in its folder: a multi-process run's workdir is shared."""
    name, _, process = skip_log.name.removesuffix(".jsonl").rpartition(".")
    if not (name and process.isdigit() and skip_log.name.endswith(".jsonl")):
        return [skip_log]
    others = skip_log.parent.glob(f"{glob.escape(name)}.*.jsonl")
    logs = {p for p in others if p.name.removesuffix(".jsonl").rpartition(".")[2].isdigit()}
    return sorted(logs | {skip_log})


class MemorySource:
    """A split's records held in RAM (`data.cache=memory`): one bytes buffer plus offsets, read
    once from a `CheckedSource` after the checksums were verified; the same random-access
    interface, so every epoch is served without touching the (slow or shared) storage."""

    def __init__(self, source: CheckedSource, block: int = 4096):
        parts, lengths, missing = [], [], []
        for start in range(0, len(source), block):
            stop = min(start + block, len(source))
            for i, record in enumerate(source.read_many(range(start, stop))):
                if record is None:  # data.skip_corrupt: keep the index, served as None
                    missing.append(start + i)
                    record = b""
                parts.append(record)
                lengths.append(len(record))
        self.buffer = b"".join(parts)
        self.offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.missing = frozenset(missing)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> bytes | None:
        if index in self.missing:
            return None
        return self.buffer[self.offsets[index] : self.offsets[index + 1]]

    def read_many(self, indices: Sequence[int]) -> list[bytes | None]:
        return [self[int(i)] for i in indices]


def memory_needed(num_records: int, num_tokens: int, dtype: str) -> int:
    """Bytes a split takes in `MemorySource`: its tokens plus one offset per record (while it is
    joined from its records, twice that)."""
    return num_tokens * np.dtype(dtype).itemsize + 8 * (num_records + 1)


def available_memory() -> int:
    """Bytes this host can still allocate without swapping (`MemAvailable`)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _corrupt_message(path: str, err: Exception) -> str:
    lines = str(err).splitlines()
    reason = lines[0][:120] if lines else "unreadable index"
    fix = "--overwrite, or set data.skip_corrupt=true to skip unreadable records"
    return damaged_shard(path, reason, fix)
