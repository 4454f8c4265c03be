"""Tokenized records in TFRecord shards, and Grain's reader for them.

A shard `{split}-{i:05d}-of-{n:05d}.tfrecord` is uncompressed; each record is one
`tf.train.Example` whose single int64 feature `tokens` holds one document (or one bounded piece
of a long one) — the same records an ArrayRecord shard holds, so both formats feed the same
packing. TensorFlow is imported only on first use (`tensorflow()`, shared with `tfdata.py`): its
import time and memory (BENCHMARKS.md) are not for ArrayRecord users to pay.

Grain reads TFRecord sequentially (no random access), so this host's shards are shuffled per
epoch by file order, interleaved, and shuffled within a seeded window of records; the iterator
state is each open shard's byte offset plus the window position, and restores exactly.
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grain
import numpy as np

from input_pipeline.dataset_info import INFO_FILE, DatasetInfo
from input_pipeline.errors import DataError, damaged_shard
from input_pipeline.positions import DamagedPositionError
from input_pipeline.reading import Reading
from input_pipeline.records import Codec, SkipLog
from input_pipeline.shares import EndOfShare, ShareUnreadable, worker_share

FEATURE = "tokens"
READERS = ("auto", "grain", "tfdata")
SHUFFLE_RECORDS = 1024  # records in Grain's shuffle window and in tf.data's shuffle buffer
PREFETCH_RECORDS = 32  # parsed records buffered ahead per open shard


def tensorflow():
    """TensorFlow, imported on first use and kept off any GPU (the GPU belongs to JAX)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Only parse ops run in TF here; oneDNN would change nothing but print a startup line.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    import tensorflow as tf

    with contextlib.suppress(RuntimeError):  # raised once TF is initialized: the setting holds
        tf.config.set_visible_devices([], "GPU")
    return tf


def tfrecord_codec(dtype: np.dtype) -> Codec:
    """How a TFRecord shard is opened and a record encoded (one `tf.train.Example`)."""
    tf = tensorflow()

    def encode(tokens: np.ndarray) -> bytes:
        values = tf.train.Int64List(value=np.asarray(tokens, dtype=dtype).tolist())
        feature = {FEATURE: tf.train.Feature(int64_list=values)}
        return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()

    return tf.io.TFRecordWriter, encode


def host_shards(
    info: DatasetInfo, split: str, process_index: int, process_count: int, finite: bool = False
) -> list:
    """This reader's shard files: TFRecord has no random access, so readers (hosts or data
    streams) split the split by whole shard. A `finite` pass (eval) leaves readers beyond the
    shard count without one; training needs a shard for every reader."""
    paths = [str(p) for p in info.shard_paths(split)]
    if len(paths) < process_count and not finite:
        raise DataError(
            f"{info.path} has {len(paths)} {split} shards for {process_count} readers (hosts, "
            "or data.streams); TFRecord data is split between readers by whole shard: re-run "
            f"python -m input_pipeline.prepare --format tfrecord --num-shards {process_count} "
            "(or a multiple) --overwrite"
        )
    return paths[process_index::process_count]


def grain_records(
    paths: list[str], vocab_size: int, reading: Reading, listed: dict[str, int]
) -> grain.IterDataset:
    """Decoded `{"inputs", "targets"}` records of TFRecord shards `paths`, read by Grain;
    `listed`: the records dataset.json lists per shard, which a shard read whole must hold."""
    files = grain.MapDataset.source(paths)
    if reading.shuffle:
        files = files.shuffle(seed=reading.seed)  # a new file order every epoch
    empty = EmptyShards(
        paths, in_order=not reading.shuffle, workers=reading.workers, reader=reader_name(reading)
    )
    skips = SkipLog(reading.skip_log)  # shared by this reader's shards of every epoch

    def shard(path: str) -> TFRecordShard:
        return TFRecordShard(
            path, vocab_size, reading.skip_corrupt, skips, empty, listed=listed.get(path)
        )

    shards = files.repeat(reading.num_epochs).map(shard)
    # Shuffling reads several shards at once; unshuffled, shards are read in order, so one host
    # sees records in the same order as the ArrayRecord pipeline does.
    records = grain.experimental.InterleaveIterDataset(
        shards,
        cycle_length=min(reading.read_threads, len(paths)) if reading.shuffle else 1,
        iter_buffer_size=PREFETCH_RECORDS,
    )
    if reading.shuffle:
        return grain.experimental.WindowShuffleIterDataset(
            records, window_size=SHUFFLE_RECORDS, seed=reading.seed
        )
    if empty.share < len(paths):  # a Grain worker may have to stop early (`EmptyShards`)
        return EndOfShare(records)
    return records


class TFRecordShard(grain.IterDataset):
    """One shard through `CheckedRecords`, parsed to next-token pairs; custom because Grain's
    reader neither checks a record's CRC, names a damaged file nor skips damaged records: damage
    becomes a `DataError` naming the file, or with `skip_corrupt` a logged skip. A shard read
    whole that ends before the `listed` records (dataset.json's count) lost the rest: damage too
    (a zero-length shard, or one cut between two records, reads as a shorter shard); one that
    holds more is not the shard dataset.json lists."""

    def __init__(
        self,
        path: str,
        vocab_size: int,
        skip_corrupt: bool,
        skips: SkipLog | None = None,
        empty: EmptyShards | None = None,
        listed: int | None = None,
    ):
        super().__init__()
        self.path = path
        self.vocab_size = vocab_size
        self.skip_corrupt = skip_corrupt
        self.skips = SkipLog(None) if skips is None else skips
        self.empty = EmptyShards([path], in_order=True) if empty is None else empty
        self.listed = listed

    def __iter__(self) -> grain.DatasetIterator:
        return _ShardIterator(self)

    def __str__(self) -> str:
        return f"TFRecordShard({self.path})"


class _ShardIterator(grain.DatasetIterator):
    def __init__(self, shard: TFRecordShard):
        super().__init__()
        self._shard = shard
        self._example = tensorflow().train.Example
        self._good = 0  # records returned: a shard read whole that returns none is `empty`
        self._framed = 0  # records met, readable or not, in a read from the shard's start
        self._whole: bool | None = True  # read from its start, not resumed mid-shard; None: ended
        try:
            self._records = CheckedRecords(shard.path)
        except OSError as err:
            raise DataError(_damaged(shard.path, err.strerror or str(err))) from None
        self._framing = framed(self._records)

    def __next__(self) -> dict[str, np.ndarray] | ShareUnreadable:
        while (met := self._next_framed()) is not None:
            offset, record = met
            self._count_framed()
            if isinstance(record, DamagedRecordError):
                self._bad(offset, record.problem)
                continue
            tokens, problem = parse_example(self._example, record, self._shard.vocab_size)
            if problem is None:
                self._good += 1
                return {"inputs": tokens[:-1], "targets": tokens[1:]}
            self._bad(offset, problem)
        self._lost(self._records.offset)
        return self._ended()

    def _next_framed(self) -> tuple[int, bytes | DamagedRecordError] | None:
        """The next record met and its offset, None at the end (`framed`)."""
        try:
            return next(self._framing, None)
        except OSError as err:
            raise DataError(_damaged(self._shard.path, str(err))) from None

    def _count_framed(self) -> None:
        """One more record met; in a whole read, one past the records dataset.json lists means
        the shard is not the one listed."""
        self._framed += 1
        listed = self._shard.listed
        if self._whole and listed is not None and self._framed > listed:
            raise DataError(more_than_listed(self._shard.path, listed))

    def _lost(self, offset: int) -> None:
        """At the end of a whole read: the records dataset.json lists past those met are lost,
        an error, or with `skip_corrupt` each listed as skipped."""
        listed, path = self._shard.listed, self._shard.path
        if not self._whole or listed is None or self._framed >= listed:
            return
        if not self._shard.skip_corrupt:
            raise DataError(
                _damaged(
                    path,
                    f"it ends at byte {offset} after {self._framed} of the {listed} "
                    "records dataset.json lists",
                )
            )
        for record in range(self._framed, listed):
            self._shard.skips.add((path, "record", record), {"shard": path, "record": record})

    def _ended(self) -> ShareUnreadable:
        """Raise `StopIteration`; return `ShareUnreadable` instead where this shard
        was the last of this Grain worker's to be found empty and another shard is readable."""
        if self._whole is not None:  # said once, however often Grain asks again
            whole, self._whole = self._whole, None
            readable = functools.partial(any_readable_record, vocab_size=self._shard.vocab_size)
            if self._shard.empty.shard_ended(self._shard.path, self._good, whole, readable):
                return ShareUnreadable()
        raise StopIteration

    def _bad(self, offset: int, problem: str) -> None:
        path = self._shard.path
        if not self._shard.skip_corrupt:
            raise DataError(
                _damaged(path, f"{problem} at byte {offset}")
                if problem in (UNPARSABLE, TRUNCATED, CORRUPTED)
                else wrong_example(path, f"the record at byte {offset}", problem)
            )
        self._shard.skips.add((path, offset), {"shard": path, "offset": offset})

    def get_state(self) -> dict[str, Any]:
        return {"reader_offset": self._records.offset}

    def set_state(self, state: dict[str, Any]) -> None:
        offset, size = state["reader_offset"], self._records.size
        if offset > size:  # read as the shard's end: the rest of it skipped in silence
            raise DamagedPositionError(
                f"the TFRecord reader's reader_offset is {offset}, past the {size} bytes of "
                f"shard {self._shard.path}"
            )
        self._records.offset = offset
        self._framing = framed(self._records)
        self._whole = state.get("reader_offset", 0) == 0
        self._framed = 0


def framed(records: CheckedRecords) -> Iterator[tuple[int, bytes | DamagedRecordError]]:
    """`records` from their `offset` on, each with the offset it starts at: its bytes, or the
    damage that keeps it from being read (a record failing its CRC is stepped over). Ends at the
    shard's end, or at damage past which nothing can be framed, `offset` left at it: a read
    resumed there meets the same damage, not records framed from garbage."""
    while True:
        offset = records.offset
        try:
            record = next(records)
        except StopIteration:
            return
        except DamagedRecordError as damage:
            if damage.next_offset is not None:
                records.offset = damage.next_offset
            yield offset, damage
            if damage.next_offset is None:
                return
            continue
        yield offset, record


class DamagedRecordError(Exception):
    """A record `CheckedRecords` cannot return: `problem` says why, `next_offset` is where the
    next record starts, None where the rest of the shard cannot be framed."""

    def __init__(self, problem: str, next_offset: int | None):
        super().__init__(problem)
        self.problem, self.next_offset = problem, next_offset


class CheckedRecords:
    """A TFRecord shard's records, each checked against its CRC32C by TensorFlow's own reader
    (Grain's checks none: a flipped byte was read as another token, in silence). `offset` is
    where the next record starts, as `reader_offset` is in Grain's reader's state, so data
    positions saved with either restore with the other."""

    def __init__(self, path: str):
        tf = tensorflow()
        self.path, self.offset = path, 0
        self._lost, self._failed = tf.errors.DataLossError, tf.errors.OpError
        try:
            # The reader behind tf.data's TFRecordDataset, with random access by byte offset;
            # not exported under tf.*, so pinned by the tensorflow-cpu version range.
            from tensorflow.python.lib.io.tf_record import tf_record_random_reader

            self._reader = tf_record_random_reader(path)
        except tf.errors.OpError as err:
            raise OSError(err.message) from None
        self.size = os.path.getsize(path)

    def __iter__(self) -> CheckedRecords:
        return self

    def __next__(self) -> bytes:
        try:
            record, self.offset = self._reader.read(self.offset)
        except IndexError:  # no whole header at `offset`: the end, or a cut inside a header
            if self.offset >= self.size:
                raise StopIteration from None
            raise DamagedRecordError(TRUNCATED, None) from None
        except self._lost:
            raise DamagedRecordError(*self._diagnose()) from None
        except self._failed as err:  # not a file, an I/O error: TensorFlow's own error types
            raise OSError(err.message) from None
        return record

    def _diagnose(self) -> tuple[str, int | None]:
        """Why the record at `offset` failed its check: a payload that fails its CRC (the next
        record still starts where its header says), else a cut, or a length field that fails
        its own CRC (nothing after it can be framed)."""
        with open(self.path, "rb") as shard:
            shard.seek(self.offset)
            header = shard.read(12)
        if len(header) < 12:
            return TRUNCATED, None
        length, length_crc = struct.unpack("<QI", header)
        end = self.offset + 16 + length
        if masked_crc32c(header[:8]) == length_crc and end <= self.size:
            return CORRUPTED, end
        return TRUNCATED, None


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of `data`, bit by bit: it checks 8-byte length fields only,
    and only of records that failed TensorFlow's own check."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class EmptyShards:
    """Which of a reader's shards, read whole, returned no record: with `data.skip_corrupt` a
    reader (or Grain worker) whose shards all do would skip every record forever. Checked once
    per shard read, never per record.

    Grain worker i of W reads the i-th, (i+W)-th, ... shard of the repeated shard list, so
    unshuffled (`in_order`) it reads exactly the shards whose index is i modulo gcd(W, shards):
    its `share`. Once every shard of a share is found empty, the other shards are checked once:
    if one holds a readable record the worker ends its reads (another worker reads that shard),
    otherwise nothing is readable and that is a `DataError`. Shuffled, a new order every epoch
    brings every shard to every worker: the share is all of them. `reader` names the reader in
    that error (`reader_name`)."""

    def __init__(
        self, paths: list[str], in_order: bool, workers: int = 0, reader: str = "this reader"
    ):
        self.paths = list(paths)  # in the order the reader cycles through them
        self.reader = reader
        # How many of the shards one Grain worker reads: ArrayRecord's rule, one shard per read.
        self.share = worker_share(len(self.paths), 1, workers, shuffle=not in_order)
        self.stride = len(self.paths) // self.share  # a worker's shards are this far apart
        self.index = {path: i for i, path in enumerate(self.paths)}
        self.empty: set[str] = set()  # shards read whole that returned no record
        self.share_unreadable = False  # every shard this worker reads is empty, others are not

    def share_of(self, path: str) -> list[str]:
        """The shards of the Grain worker that reads `path`."""
        return self.paths[self.index[path] % self.stride :: self.stride]

    def shard_ended(
        self, path: str, returned: int, whole: bool, any_readable: Callable[[list[str]], bool]
    ) -> bool:
        """Note the end of a read of `path` that `returned` records; True once every shard of
        this worker's share is empty while `any_readable(the other shards)` says one is not."""
        if returned or not whole:
            return False
        self.empty.add(path)
        if self.share_unreadable:
            return True
        share = self.share_of(path)
        if not self.empty.issuperset(share):
            return False
        others = [p for p in self.paths if p not in share]
        if not others or not any_readable(others):
            raise DataError(no_readable_record(self.paths, self.reader))
        self.share_unreadable = True
        return True


def any_readable_record(paths: list[str], vocab_size: int) -> bool:
    """Whether any TFRecord shard of `paths` holds one of our records, read up to the first."""
    example = tensorflow().train.Example
    for path in paths:
        with contextlib.suppress(OSError):  # a shard that cannot be read holds none
            records = (r for _, r in framed(CheckedRecords(path)) if isinstance(r, bytes))
            if any(parse_example(example, r, vocab_size)[1] is None for r in records):
                return True
    return False


def reader_name(reading: Reading) -> str:
    """Which reader a line means: the data stream, where `data.streams` (or hosts) make several."""
    if reading.process_count == 1:
        return "this reader"
    return f"data stream {reading.process_index} of {reading.process_count}"


def no_readable_record(paths: list[str], reader: str) -> str:
    """A reader with nothing left to read: every record of its shards was skipped or absent."""
    return (
        f"the {len(paths)} TFRecord shard(s) {reader} reads hold no readable record "
        f"(first {paths[0]}): each is empty, or data.skip_corrupt=true skipped every record, "
        "so there is nothing to read; restore those shards or re-run python -m "
        "input_pipeline.prepare --format tfrecord --overwrite"
    )


UNPARSABLE = "unparsable tf.train.Example"
TRUNCATED = "truncated record or garbled length"
CORRUPTED = "record failing its CRC check"


def parse_example(example: Any, record: bytes, vocab_size: int) -> tuple[np.ndarray, str | None]:
    """A record's int32 tokens, or what keeps it from being one of our records: not a
    `tf.train.Example` (`UNPARSABLE`), no int64 `tokens` feature, ids outside the vocabulary."""
    try:
        features = example.FromString(record).features.feature
    except Exception:  # protobuf's DecodeError type differs between its implementations
        return np.empty(0, np.int32), UNPARSABLE
    if FEATURE not in features:
        return np.empty(0, np.int32), f"has no {FEATURE!r} feature (it has: {', '.join(features)})"
    kind = features[FEATURE].WhichOneof("kind")
    if kind != "int64_list":
        return np.empty(0, np.int32), f"holds {FEATURE!r} as a {kind}, not an int64_list"
    tokens = np.array(features[FEATURE].int64_list.value, dtype=np.int64)
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        return tokens, f"holds token ids outside the vocabulary of {vocab_size}"
    return tokens.astype(np.int32), None


def more_than_listed(path: str, listed: int) -> str:
    """A shard holding records past those dataset.json lists: not the shard it lists."""
    return (
        f"shard {path} holds more than the {listed} records {Path(path).parent / INFO_FILE} "
        "lists (the two do not belong together); restore them or re-run python -m "
        "input_pipeline.prepare --format tfrecord --overwrite"
    )


def wrong_example(path: str, where: str, problem: str) -> str:
    """A readable record that is not ours: the fix is in how the data was written."""
    return (
        f"shard {path}: {where} {problem}; TFRecord data holds one tf.train.Example per record "
        f"with an int64 {FEATURE!r} feature of token ids below dataset.json's vocab_size: write "
        "it so, or re-run python -m input_pipeline.prepare --format tfrecord --overwrite"
    )


def _damaged(path: str, reason: str) -> str:
    fix = "--format tfrecord --overwrite, or set data.skip_corrupt=true (data.reader=grain)"
    return damaged_shard(path, reason, f"{fix} to skip unreadable records")
