"""TFRecord shards through tf.data, built as tf.data's performance guide says: files interleaved
in parallel (deterministically), a seeded shuffle buffer, a vectorized `parse_example` on batches
of serialized records, and `prefetch(AUTOTUNE)`. It yields the same decoded `{"inputs",
"targets"}` records as the Grain readers, as a Grain `IterDataset`, so the packing, batching and
batch contract that follow are the shared ones.

Exact resume uses tf.data's own iterator checkpoint (`SerializeIterator`, what
`tf.train.Checkpoint` saves), kept as base64 in the JSON state. That checkpoint holds the
shuffle and prefetch buffers, megabytes far too slow to write each time Grain asks for the
state, which is after every record. So the state is an *anchor* — the tf.data checkpoint
taken at a parse-batch boundary — plus the number of records read since; restoring
deserializes the anchor and reads that many records again. A new anchor is taken once the time
since the last one exceeds `ANCHOR_COST_RATIO` times what it cost, which keeps the overhead
near 2% and the re-read on restore to a few seconds of reading at most, or once
`ANCHOR_RECORDS` records were read since: that bounds the count a run saves, so a larger one
(a damaged file) is refused instead of re-read for hours.
"""

from __future__ import annotations

import base64
import collections
import os
import re
import time
from typing import Any

import grain
import numpy as np

from input_pipeline.errors import DataError, damaged_shard
from input_pipeline.positions import DamagedPositionError
from input_pipeline.reading import Reading
from input_pipeline.tfrecords import (
    FEATURE,
    SHUFFLE_RECORDS,
    more_than_listed,
    parse_example,
    tensorflow,
    wrong_example,
)

PARSE_BATCH = 256  # serialized records per vectorized parse_example call
ANCHOR_COST_RATIO = 50  # seconds between anchors / seconds one anchor costs
ANCHOR_RECORDS = 1 << 18  # records read since the last anchor that take a new one at most


def make_tf_dataset(
    paths: list[str], listed: list[int], *, shuffle: bool, seed: int, num_epochs: int | None
):
    """Batches of parsed records: `(values, row_splits)` of the int32 token rows. A shard
    holding other than its `listed` records (dataset.json's count) fails its read with a
    `FailedPreconditionError`: one cut between two records, or with records added, is no
    shorter or longer shard."""
    tf = tensorflow()
    autotune = tf.data.AUTOTUNE
    files = tf.data.Dataset.from_tensor_slices((paths, tf.constant(listed, tf.int64)))
    if shuffle:  # a new, seeded file order every epoch
        files = files.shuffle(len(paths), seed=seed, reshuffle_each_iteration=True)
    files = files.repeat(num_epochs)

    def listed_records(path, count):
        return tf.data.TFRecordDataset(path).apply(tf.data.experimental.assert_cardinality(count))

    # Unshuffled, shards are read one after another: the order the other readers give.
    records = files.interleave(
        listed_records,
        cycle_length=min(4, len(paths)) if shuffle else 1,
        num_parallel_calls=autotune,
        deterministic=True,
    )
    if shuffle:
        records = records.shuffle(SHUFFLE_RECORDS, seed=seed, reshuffle_each_iteration=True)
    spec = {FEATURE: tf.io.RaggedFeature(tf.int64)}

    def parse(serialized):
        tokens = tf.io.parse_example(serialized, spec)[FEATURE]
        return tf.cast(tokens.values, tf.int32), tokens.row_splits

    batches = records.batch(PARSE_BATCH).map(parse, num_parallel_calls=autotune, deterministic=True)
    return batches.prefetch(autotune)


def tfdata_records(
    paths: list[str], listed: list[int], reading: Reading, vocab_size: int
) -> TfDataRecords:
    """This reader's TFRecord shards `paths` through tf.data (`data.reader=tfdata`), each
    holding its `listed` records (dataset.json's counts), token ids checked against
    `vocab_size`."""
    if reading.skip_corrupt:
        raise DataError(
            "data.skip_corrupt=true is not supported by data.reader=tfdata (tf.data cannot "
            "count what it skips); use data.reader=grain, or re-run prepare --overwrite"
        )
    if reading.workers > 0:
        raise DataError(
            f"data.workers={reading.workers} does not apply to data.reader=tfdata, which runs "
            "its own parallel reads; set data.workers=0 or use data.reader=grain"
        )
    for path in paths:  # tf.data reads an empty file as a shard without records, in silence
        if os.path.getsize(path) == 0:
            raise DataError(_damaged(path, "0 bytes, where dataset.json lists its records"))
    return TfDataRecords(
        paths,
        listed,
        vocab_size=vocab_size,
        shuffle=reading.shuffle,
        seed=reading.seed,
        num_epochs=reading.num_epochs,
    )


class TfDataRecords(grain.IterDataset):
    """Shards `paths` read by tf.data, as a Grain source of decoded records whose iterator
    state restores exactly."""

    def __init__(
        self,
        paths: list[str],
        listed: list[int],
        *,
        vocab_size: int,
        shuffle: bool,
        seed: int,
        num_epochs: int | None,
    ):
        super().__init__()
        self.paths, self.listed, self.vocab_size = paths, listed, vocab_size
        self.options = {"shuffle": shuffle, "seed": seed, "num_epochs": num_epochs}

    def __iter__(self) -> grain.DatasetIterator:
        return _TfDataIterator(self)

    def __str__(self) -> str:
        return f"TfDataRecords({len(self.paths)} shards)"


class _TfDataIterator(grain.DatasetIterator):
    def __init__(self, source: TfDataRecords):
        super().__init__()
        self._tf = tensorflow()
        self._paths, self._listed = source.paths, source.listed
        self._vocab_size = source.vocab_size
        self._empty_rows_checked = False  # empty rows: empty int64 lists, or no `tokens` feature
        self._iterator = iter(make_tf_dataset(source.paths, source.listed, **source.options))
        self._pending: collections.deque = collections.deque()  # records of the parsed batch
        self._anchor = ""
        self._since_anchor = 0
        self._anchored_at = 0.0
        self._anchor_cost = 0.0
        self._reanchor()

    def __next__(self) -> dict[str, np.ndarray]:
        if not self._pending:
            if self._since_anchor >= ANCHOR_RECORDS or (
                time.perf_counter() - self._anchored_at > ANCHOR_COST_RATIO * self._anchor_cost
            ):
                self._reanchor()
            self._pending.extend(self._next_batch())
        self._since_anchor += 1
        return self._pending.popleft()

    def _next_batch(self) -> list[dict[str, np.ndarray]]:
        try:
            values, splits = next(self._iterator)
        except (
            self._tf.errors.DataLossError,  # a record failing its CRC, or cut
            self._tf.errors.InvalidArgumentError,  # a record not one of ours
            self._tf.errors.FailedPreconditionError,  # other records than listed; not a file
        ) as err:
            raise DataError(self._diagnose(err)) from None
        values, splits = values.numpy(), splits.numpy()
        self._check(values, splits)
        rows = [values[start:end] for start, end in zip(splits[:-1], splits[1:], strict=True)]
        return [{"inputs": row[:-1], "targets": row[1:]} for row in rows]

    def _reanchor(self) -> None:
        """Checkpoint the tf.data iterator here, between parse batches."""
        start = time.perf_counter()
        tf = self._tf
        variant = tf.raw_ops.SerializeIterator(
            resource_handle=self._iterator._iterator_resource,  # what tf.train.Checkpoint saves
            external_state_policy=tf.data.experimental.ExternalStatePolicy.FAIL.value,
        )
        self._anchor = base64.b64encode(tf.io.serialize_tensor(variant).numpy()).decode()
        self._since_anchor = 0
        self._anchored_at = time.perf_counter()
        self._anchor_cost = self._anchored_at - start

    def get_state(self) -> dict[str, Any]:
        return {"tf_iterator": self._anchor, "records_after": self._since_anchor}

    def set_state(self, state: dict[str, Any]) -> None:
        check_records_after(state["records_after"])
        tf = self._tf
        serialized = tf.io.parse_tensor(base64.b64decode(state["tf_iterator"]), tf.variant)
        tf.raw_ops.DeserializeIterator(
            resource_handle=self._iterator._iterator_resource, serialized=serialized
        )
        self._anchor = state["tf_iterator"]
        self._anchored_at = time.perf_counter()
        self._pending.clear()
        self._since_anchor = 0
        for _ in range(state["records_after"]):  # re-read up to the saved record
            if not self._pending:
                self._pending.extend(self._next_batch())
            self._pending.popleft()
            self._since_anchor += 1

    def _check(self, values: np.ndarray, splits: np.ndarray) -> None:
        """What the vectorized parse lets through: ids outside the vocabulary, and records
        without a `tokens` feature, which it reads as empty rows."""
        outside = len(values) and (values.min() < 0 or values.max() >= self._vocab_size)
        empty = not self._empty_rows_checked and bool((splits[1:] == splits[:-1]).any())
        if outside or empty:
            problem = self._wrong_example()
            if problem is not None:
                raise DataError(problem)
            self._empty_rows_checked = True  # every empty row is an empty int64 list

    def _wrong_example(self) -> str | None:
        """The first record, in shard order, that is not one of our records."""
        example = self._tf.train.Example
        for path in self._paths:
            for i, record in enumerate(self._tf.data.TFRecordDataset(path).as_numpy_iterator()):
                _, problem = parse_example(example, record, self._vocab_size)
                if problem is not None:
                    return wrong_example(path, f"record {i}", problem)
        return None

    def _diagnose(self, err: Exception) -> str:
        """tf.data names no file in its errors: re-read each shard alone to find the bad one."""
        errors = self._tf.errors
        for path, listed in zip(self._paths, self._listed, strict=True):
            try:
                for _ in make_tf_dataset([path], [listed], shuffle=False, seed=0, num_epochs=1):
                    pass
            except errors.InvalidArgumentError as bad:  # a feature of another type
                return self._wrong_example() or _damaged(path, _reason(bad))
            except errors.DataLossError as bad:
                return _damaged(path, _reason(bad))
            except errors.FailedPreconditionError as bad:
                return self._not_as_listed(path, listed) or _damaged(path, _reason(bad))
        return _damaged(f"of {', '.join(self._paths)}", _reason(err))

    def _not_as_listed(self, path: str, listed: int) -> str | None:
        """Why shard `path` failed its count check: fewer records than the `listed` ones (a cut
        between two records) or more; None where it cannot be read to count."""
        try:
            found = sum(1 for _ in self._tf.data.TFRecordDataset(path))
        except self._tf.errors.OpError:  # not a file, say
            return None
        if found == listed:
            return None
        if found > listed:
            return more_than_listed(path, listed)
        return _damaged(path, f"it ends after {found} of the {listed} records dataset.json lists")


def check_records_after(records: int) -> None:
    """A `DamagedPositionError` for more records since an anchor than a run reads before it
    takes the next one (`ANCHOR_RECORDS`, checked between parse batches)."""
    most = ANCHOR_RECORDS + PARSE_BATCH - 1
    if records > most:
        raise DamagedPositionError(
            f"the tf.data reader's records_after is {records}, past the {most} records it reads "
            "between two of its checkpoints"
        )


def _reason(err: Exception) -> str:
    """The useful words of a TF error, e.g. `corrupted record at 12`."""
    text = str(err)
    found = re.search(r"(corrupted|truncated) record at \d+", text)
    if found:
        return found.group(0)
    return re.sub(r"\{\{.*?\}\}|\[Op:.*", "", text).strip()[:160] or type(err).__name__


def _damaged(path: str, reason: str) -> str:
    fix = "--format tfrecord --overwrite (data.skip_corrupt needs data.reader=grain)"
    return damaged_shard(path, reason, fix)
