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
from typing import Any

import grain
import numpy as np

from input_pipeline.dataset_info import DatasetInfo
from input_pipeline.errors import DataError
from input_pipeline.reading import Reading
from input_pipeline.records import Codec, SkipLog

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


def grain_records(paths: list[str], vocab_size: int, reading: Reading) -> grain.IterDataset:
    """Decoded `{"inputs", "targets"}` records of TFRecord shards `paths`, read by Grain."""
    files = grain.MapDataset.source(paths)
    if reading.shuffle:
        files = files.shuffle(seed=reading.seed)  # a new file order every epoch
    shard = functools.partial(
        TFRecordShard,
        vocab_size=vocab_size,
        skip_corrupt=reading.skip_corrupt,
        skips=SkipLog(reading.skip_log),  # shared by this reader's shards of every epoch
        empty=EmptyShards(paths, in_order=not reading.shuffle),
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
        records = grain.experimental.WindowShuffleIterDataset(
            records, window_size=SHUFFLE_RECORDS, seed=reading.seed
        )
    return records


class TFRecordShard(grain.IterDataset):
    """One shard through `grain.experimental.TFRecordIterDataset`, parsed to next-token pairs;
    custom because Grain's reader neither names a damaged file nor skips damaged records: damage
    becomes a `DataError` naming the file, or with `skip_corrupt` a logged skip."""

    def __init__(
        self,
        path: str,
        vocab_size: int,
        skip_corrupt: bool,
        skips: SkipLog | None = None,
        empty: EmptyShards | None = None,
    ):
        super().__init__()
        self.path = path
        self.vocab_size = vocab_size
        self.skip_corrupt = skip_corrupt
        self.skips = SkipLog(None) if skips is None else skips
        self.empty = EmptyShards([path], in_order=True) if empty is None else empty

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
        self._whole: bool | None = True  # read from its start, not resumed mid-shard; None: ended
        try:
            self._records = iter(grain.experimental.TFRecordIterDataset(shard.path))
        except OSError as err:
            raise DataError(_damaged(shard.path, err.strerror or str(err))) from None

    def __next__(self) -> dict[str, np.ndarray]:
        while True:
            offset = self._records.get_state()["reader_offset"]
            try:
                record = next(self._records)
            except StopIteration:
                self._ended()
                raise
            except (ValueError, OverflowError, MemoryError):  # a cut or garbled length field
                self._bad(offset, TRUNCATED)
                self._ended()
                raise StopIteration from None  # the rest of the shard cannot be framed
            tokens, problem = parse_example(self._example, record, self._shard.vocab_size)
            if problem is None:
                if not self._good:  # the reader has something to read: said at once
                    self._shard.empty.returned_any = True
                self._good += 1
                return {"inputs": tokens[:-1], "targets": tokens[1:]}
            self._bad(offset, problem)

    def _ended(self) -> None:
        if self._whole is not None:  # said once, however often Grain asks again
            self._shard.empty.shard_ended(self._shard.path, self._good, self._whole)
            self._whole = None

    def _bad(self, offset: int, problem: str) -> None:
        path = self._shard.path
        if not self._shard.skip_corrupt:
            raise DataError(
                _damaged(path, f"{problem} at byte {offset}")
                if problem in (UNPARSABLE, TRUNCATED)
                else wrong_example(path, f"the record at byte {offset}", problem)
            )
        self._shard.skips.add((path, offset), {"shard": path, "offset": offset})

    def get_state(self) -> dict[str, Any]:
        return self._records.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._records.set_state(state)
        self._whole = state.get("reader_offset", 0) == 0


class EmptyShards:
    """Which of a reader's shards, read whole, returned no record: with `data.skip_corrupt` a
    reader whose shards all do would skip every record forever, so that is a `DataError`.
    Checked once per shard read, never per record. `in_order` (unshuffled): the reader (or a
    Grain worker, which may see only some shards) goes round its shards in a fixed order, so a
    shard found empty a third time with no record returned yet closes two whole rounds; two,
    because Grain opens the next shards before the current one's first record is read."""

    ROUNDS = 3

    def __init__(self, paths: list[str], in_order: bool):
        self.paths = sorted(set(paths))
        self.in_order = in_order
        self.empty: dict[str, int] = {}  # shard -> whole reads that returned no record
        self.returned_any = False

    def shard_ended(self, path: str, returned: int, whole: bool) -> None:
        self.returned_any = self.returned_any or returned > 0
        if not whole or self.returned_any:
            return
        self.empty[path] = self.empty.get(path, 0) + 1
        rounds = self.in_order and self.empty[path] >= self.ROUNDS
        if len(self.empty) == len(self.paths) or rounds:
            raise DataError(no_readable_record(sorted(self.empty), len(self.paths)))


def no_readable_record(empty: list[str], total: int) -> str:
    """A reader with nothing left to read: every record of its shards was skipped or absent."""
    share = "" if len(empty) == total else f" of the {total} of this split"
    other = (
        ""
        if len(empty) == total
        else " (unshuffled, each of data.workers reads a fixed share of the shards: "
        "data.shuffle=true spreads them)"
    )
    return (
        f"the {len(empty)} TFRecord shard(s){share} this reader reads hold no readable record "
        f"(first {empty[0]}): each is empty, or data.skip_corrupt=true skipped every record, "
        "so there is nothing to read; restore those shards or re-run python -m "
        f"input_pipeline.prepare --format tfrecord --overwrite{other}"
    )


UNPARSABLE = "unparsable tf.train.Example"
TRUNCATED = "truncated record or garbled length"


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


def wrong_example(path: str, where: str, problem: str) -> str:
    """A readable record that is not ours: the fix is in how the data was written."""
    return (
        f"shard {path}: {where} {problem}; TFRecord data holds one tf.train.Example per record "
        f"with an int64 {FEATURE!r} feature of token ids below dataset.json's vocab_size: write "
        "it so, or re-run python -m input_pipeline.prepare --format tfrecord --overwrite"
    )


def _damaged(path: str, reason: str) -> str:
    return (
        f"shard {path} is corrupt or truncated ({reason}); re-run python -m "
        "input_pipeline.prepare --format tfrecord --overwrite, or set data.skip_corrupt=true "
        "(data.reader=grain) to skip unreadable records"
    )
