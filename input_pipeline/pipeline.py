"""The one Grain chain, reading like the data flow:

per-host split -> seeded global shuffle (new order every epoch) -> repeat -> decode -> pack to
seq_len -> batch (this host's share) -> batch contract -> optional worker processes.

Batch contract: `inputs`, `targets`, `segment_ids`, `positions` int32 `[B, L]`, `weights` float32
`[B, L]` (0 on padding). Segment ids restart at 1 per row, 0 marks padding; a row holds at most
`max_docs_per_row` segments (both packers pad the rest of a row that reaches it).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import grain
import numpy as np

from input_pipeline.dataset_info import INFO_FILE, DatasetInfo
from input_pipeline.errors import DataError
from input_pipeline.mixture import mixture_sources
from input_pipeline.packing import ConcatPackIterDataset, check_rows
from input_pipeline.positions import NEW_RUN, check_position, check_within
from input_pipeline.reading import Reading
from input_pipeline.records import CheckedSource, DecodeRecord, MemorySource
from input_pipeline.shares import EndOfShare, ShareUnreadable, UnreadableRecords, worker_share
from input_pipeline.tfdata import tfdata_records
from input_pipeline.tfrecords import READERS, SHUFFLE_RECORDS, grain_records, host_shards
from input_pipeline.workers import host_only_worker

PACKING_MODES = ("concat", "first_fit")
# none: concat rows are cut where the stream of records puts them; random_per_epoch: each epoch's
# first record also loses a seeded 0..seq_len-1 leading pairs, which moves every cut after it.
CONCAT_OFFSETS = ("none", "random_per_epoch")
EPOCH_SHIFT_KEY = 1  # keeps the shift's random stream apart from the shuffle's
FEATURES = ("inputs", "targets")
# One Grain element per ArrayRecord read of ~1M tokens (at most MAX_READ_RECORDS records): fewer,
# larger reads spread decompression over ArrayRecord's own threads (BENCHMARKS.md). Restoring a
# checkpoint re-reads one read.
READ_TOKENS = 1 << 20
MAX_READ_RECORDS = 4096
READ_DATA = {
    "arrayrecord": "ArrayRecord data",
    "grain": "TFRecord data with data.reader=grain",
    "tfdata": "TFRecord data with data.reader=tfdata",
}


class ReadRecords(grain.transforms.Map):
    """Read number `n` -> its `per_read` decoded records of this host's stream: records
    `host_index::host_count`, in a seeded permutation that is new every epoch, repeated.

    Custom, not Grain's `MapDataset.shuffle().repeat()`: that costs ~13-15 us per record
    (BENCHMARKS.md, "Measurements moved out of docstrings"), a numpy permutation per epoch
    nothing, and Grain has no per-epoch shift. Many records per Grain element keep Grain's
    per-element cost off the per-record path. Records `CheckedSource` could not read
    (`data.skip_corrupt`) are dropped; `workers` (Grain worker processes, each taking every
    `workers`-th read) bounds what one worker can reach (`worker_share`). With `epoch_shift` > 0
    the first record of every epoch starts a seeded `0..epoch_shift-1` pairs late (never past its
    last pair), so concat packing cuts new windows each epoch; a pure function of the read
    number, so resuming re-reads the same shifted record. `dtype` is the token_dtype `info_file`
    lists, which a record that does not fit names."""

    def __init__(
        self,
        source: CheckedSource | MemorySource,
        *,
        dtype: str,
        host_index: int,
        host_count: int,
        shuffle: bool,
        seed: int,
        num_epochs: int | None,
        per_read: int,
        epoch_shift: int = 0,
        name: str = "this split",
        workers: int = 0,
        info_file: Path | str = INFO_FILE,
    ):
        self.source = source
        self.decode = DecodeRecord(dtype, info_file)
        self.host_index, self.host_count = host_index, host_count
        self.host_records = len(range(host_index, len(source), host_count))
        self.shuffle, self.seed, self.per_read = shuffle, seed, per_read
        self.epoch_shift = epoch_shift
        self.total = None if num_epochs is None else self.host_records * num_epochs
        self._orders: dict[int, np.ndarray] = {}  # the latest epochs' permutations
        self.share = worker_share(self.host_records, per_read, workers, shuffle)
        self.name = f"{name} (data stream {host_index} of {host_count})"  # what lines call it
        self.unreadable = UnreadableRecords(self.host_records, self.name, self.share)

    @property
    def num_reads(self) -> int:
        return sys.maxsize if self.total is None else -(-self.total // self.per_read)

    def _order(self, epoch: int) -> np.ndarray:
        orders = self._orders  # read threads share this; replacing the dict keeps it consistent
        if epoch not in orders:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.host_records)
            self._orders = {**{e: o for e, o in orders.items() if e >= epoch - 1}, epoch: order}
            return order
        return orders[epoch]

    def _shifted(self, record: dict[str, np.ndarray], epoch: int) -> dict[str, np.ndarray]:
        """An epoch's first record, its first k pairs dropped: k seeded by (seed, epoch, this
        stream), below `epoch_shift` and below the record's pair count."""
        pairs = len(record["inputs"])
        rng = np.random.default_rng([self.seed, epoch, self.host_index, EPOCH_SHIFT_KEY])
        k = int(rng.integers(min(self.epoch_shift, pairs))) if pairs > 1 else 0
        return {name: value[k:] for name, value in record.items()}

    def map(self, read: int) -> list[dict[str, np.ndarray]] | ShareUnreadable:
        """Read `read`'s records, decoded; `ShareUnreadable` once every record this Grain worker
        can reach is unreadable but another worker's is not (`EndOfShare` then ends its reads)."""
        start = read * self.per_read
        stop = start + self.per_read
        if self.total is not None:
            stop = min(stop, self.total)
        epochs, local = np.divmod(np.arange(start, stop), self.host_records)
        firsts = np.flatnonzero(local == 0) if self.epoch_shift else []  # epochs' first records
        if self.shuffle:
            local = np.concatenate(
                [self._order(e)[local[epochs == e]] for e in range(epochs[0], epochs[-1] + 1)]
            )
        records = self.source.read_many(self.host_index + local * self.host_count)
        decoded = [None if record is None else self.decode.map(record) for record in records]
        for i in firsts:
            if decoded[i] is not None:
                decoded[i] = self._shifted(decoded[i], int(epochs[i]))
        kept = [record for record in decoded if record is not None]
        if not kept:
            if self.unreadable.add(local, self._any_readable):
                return ShareUnreadable()
        elif not self.unreadable.readable:
            self.unreadable.readable = True
        return kept

    def _any_readable(self, local: np.ndarray) -> bool:
        """Whether any of this stream's records `local` (those outside a worker's unreadable
        share) can be read, read `per_read` at a time up to the first that can."""
        for start in range(0, len(local), self.per_read):
            chunk = local[start : start + self.per_read]
            records = self.source.read_many(self.host_index + chunk * self.host_count)
            if any(record is not None for record in records):
                return True
        return False


def to_batch_contract(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Grain's packed feature names -> the trainer's batch dict (rows or whole batches)."""
    segment_ids = packed["inputs_segment_ids"].astype(np.int32)
    return {
        "inputs": packed["inputs"].astype(np.int32),
        "targets": packed["targets"].astype(np.int32),
        "segment_ids": segment_ids,
        "positions": packed["inputs_positions"].astype(np.int32),
        "weights": (segment_ids > 0).astype(np.float32),
    }


def padded_batches(rows: grain.IterDataset, batch_size: int) -> grain.IterDataset:
    """Packed rows -> batches in the batch contract; a short final batch is padded with
    zero-weight rows, so every eval token counts once and the step keeps its compiled shape."""
    pad = functools.partial(grain.experimental.batch_and_pad, batch_size=batch_size)
    return rows.batch(batch_size, batch_fn=pad).map(to_batch_contract)


class SplitToLength(grain.experimental.FlatMapTransform):
    """first_fit packs whole pieces: cut records longer than a row into row-sized pieces
    (Grain's packers require inputs already cut to the row length)."""

    def __init__(self, seq_len: int, max_record_tokens: int):
        self.seq_len = seq_len
        self.max_fan_out = max(1, -(-max_record_tokens // seq_len))

    def flat_map(self, element: dict[str, np.ndarray] | list[dict[str, np.ndarray]]):
        records = [element] if isinstance(element, dict) else element  # one record, or a read
        return [
            {k: v[start : start + self.seq_len] for k, v in record.items()}
            for record in records
            for start in range(0, len(record["inputs"]), self.seq_len)
        ]


def split_source(info: DatasetInfo, split: str, reading: Reading) -> CheckedSource:
    """Random access over an ArrayRecord split's shards, damaged records handled as `reading`
    says."""
    shards = info.split(split)["shards"]
    return CheckedSource(
        info.shard_paths(split),
        [s["records"] for s in shards],
        skip_corrupt=reading.skip_corrupt,
        skip_log=reading.skip_log,
    )


def memory_source(info: DatasetInfo, split: str, reading: Reading) -> MemorySource:
    """An ArrayRecord split read into RAM once (`data.cache=memory`), for every stream to share."""
    if info.format != "arrayrecord":
        raise DataError(
            f"data.cache=memory reads ArrayRecord datasets but {info.path} is {info.format}; "
            "use data.cache=none, or prepare it with --format arrayrecord"
        )
    return MemorySource(split_source(info, split, reading))


def arrayrecord_pairs(
    info: DatasetInfo,
    split: str,
    reading: Reading,
    source: MemorySource | None = None,
    epoch_shift: int = 0,
) -> grain.IterDataset:
    """This host's decoded `{"inputs", "targets"}` records of an ArrayRecord split, a list of
    ~`READ_TOKENS` tokens of records per element: split -> global shuffle (new order every
    epoch) -> repeat -> read + decode, on `reading.read_threads` threads. `source` (e.g. a
    `MemorySource`) replaces reading the shards from storage; `epoch_shift` as `ReadRecords`."""
    if info.format != "arrayrecord":
        raise DataError(
            f"{info.path} has format {info.format!r}; this version reads arrayrecord or "
            "tfrecord: re-run python -m input_pipeline.prepare --overwrite"
        )
    if reading.reader == "tfdata":
        raise DataError(
            f"data.reader=tfdata reads TFRecord data but {info.path} is ArrayRecord; use "
            "data.reader=auto, or prepare it with --format tfrecord"
        )
    source = source if source is not None else split_source(info, split, reading)
    mean_tokens = info.split(split)["tokens"] / max(1, len(source))
    reads = ReadRecords(
        source,
        dtype=info.token_dtype,
        host_index=reading.process_index,
        host_count=reading.process_count,
        shuffle=reading.shuffle,
        seed=reading.seed,
        num_epochs=reading.num_epochs,
        per_read=min(MAX_READ_RECORDS, max(1, round(READ_TOKENS / max(1.0, mean_tokens)))),
        epoch_shift=epoch_shift,
        name=f"{info.path} {split} split",
        workers=reading.workers,
        info_file=info.path / INFO_FILE,
    )
    if reads.host_records == 0 and reading.num_epochs is None:  # a finite pass may be empty
        raise DataError(
            f"{reads.name} has no records; prepare more data or set a lower data.streams"
        )
    # One read in flight per thread: Grain scans its buffer on every element, and each read
    # already holds many batches.
    threads = reading.read_threads
    options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=threads)
    pairs = grain.MapDataset.range(reads.num_reads).map(reads).to_iter_dataset(options)
    # Only where a worker's share can leave out records, a worker may have to stop early.
    return EndOfShare(pairs) if reads.share < reads.host_records else pairs


def tfrecord_pairs(info: DatasetInfo, split: str, reading: Reading) -> grain.IterDataset:
    """This host's decoded `{"inputs", "targets"}` records of a TFRecord split, read by Grain
    (`reading.reader` auto/grain) or tf.data (`tfdata`)."""
    if reading.reader not in READERS:
        raise DataError(f"data.reader={reading.reader!r} is unknown; use one of {READERS}")
    finite = reading.num_epochs is not None  # an eval pass: a reader may get no shard
    paths = host_shards(info, split, reading.process_index, reading.process_count, finite)
    if not paths:
        return grain.MapDataset.range(0).to_iter_dataset()
    listed = {str(info.path / s["file"]): s["records"] for s in info.split(split)["shards"]}
    if reading.reader == "tfdata":
        return tfdata_records(paths, [listed[p] for p in paths], reading, info.vocab_size)
    return grain_records(paths, info.vocab_size, reading, listed)


def make_batch_iterator(
    info: DatasetInfo,
    split: str,
    *,
    seq_len: int,
    batch_size: int,
    packing: str = "concat",
    reading: Reading | None = None,
    source: MemorySource | None = None,
    max_docs_per_row: int | None = None,
    concat_offset: str = "none",
) -> grain.DatasetIterator:
    """This host's batches of `split`, read as `reading` says (default `Reading()`), or from
    `source` (an ArrayRecord split already in RAM); the iterator's state checkpoints its exact
    position. Both shard formats meet the same packing. Rows hold at most `max_docs_per_row`
    documents (None: no bound); `concat_offset` is one of `CONCAT_OFFSETS`."""
    reading = reading or Reading()
    check_packing(info, seq_len, batch_size, packing, max_docs_per_row, concat_offset)
    if info.format == "tfrecord":
        pairs = tfrecord_pairs(info, split, reading)
    else:
        shift = seq_len if concat_offset == "random_per_epoch" else 0
        pairs = arrayrecord_pairs(info, split, reading, source, epoch_shift=shift)
    if packing == "concat":
        batches = ConcatPackIterDataset(
            pairs, seq_len=seq_len, batch_size=batch_size, max_docs_per_row=max_docs_per_row
        )
    else:
        max_record = int(info.raw.get("max_record_tokens", seq_len))
        pieces = grain.experimental.FlatMapIterDataset(pairs, SplitToLength(seq_len, max_record))
        rows = grain.experimental.FirstFitPackIterDataset(
            pieces,
            length_struct={name: seq_len for name in FEATURES},
            num_packing_bins=batch_size,
            seed=reading.seed,
            shuffle_bins=reading.shuffle,
            max_sequences_per_bin=max_docs_per_row,
        )
        batches = padded_batches(rows, batch_size)
    if reading.workers > 0:
        options = grain.MultiprocessingOptions(num_workers=reading.workers)
        batches = batches.mp_prefetch(options, worker_init_fn=host_only_worker)
    layout = {"workers": reading.workers, "packing": packing, "reader": reader_of(info, reading)}
    return LaidOutPosition(iter(batches), layout, position_bounds(info, reading))


def position_bounds(info: DatasetInfo, reading: Reading) -> dict[str, int]:
    """The bounds of a position's values that only the chain knows (`check_within`): the place
    in Grain's TFRecord reader's shuffle window (a shard's byte offset its reader checks)."""
    return {"pos_in_window": SHUFFLE_RECORDS} if reader_of(info, reading) == "grain" else {}


def reader_of(info: DatasetInfo, reading: Reading) -> str:
    """What reads the records, as a data position depends on it: arrayrecord, grain or tfdata."""
    if info.format != "tfrecord":
        return info.format
    return "tfdata" if reading.reader == "tfdata" else "grain"


class LaidOutPosition(grain.DatasetIterator):
    """The batch iterator, its position recording how the chain was laid out: `data.workers`
    (each Grain worker packs its own share of the reads, every `workers`-th), `data.packing` and
    the reader. A position of one layout is no position of another, so resuming it with another
    is one line, refused before any state moves (before: a KeyError from deep in Grain)."""

    def __init__(
        self,
        parent: grain.DatasetIterator,
        layout: dict[str, Any],
        bounds: dict[str, int] | None = None,
    ):
        super().__init__(parent)
        self.layout, self.bounds = layout, bounds or {}

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return {**self.layout, "batches": self._parent.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        if (sources := mixture_sources(state)) is not None:
            raise DataError(
                f"the checkpoint's data position is of a data.mixture of {sources}, but this run "
                f"reads one dataset; resume with that data.mixture, or {NEW_RUN}"
            )
        saved, batches = saved_layout(state)
        for key, value in saved.items():
            if value != self.layout[key]:
                raise DataError(layout_changed(key, value, self.layout[key]))
        check_position(batches, self._parent.get_state(), "position.batches")
        check_within(batches, self.bounds, "position.batches")
        self._parent.set_state(batches)

    def __str__(self) -> str:
        return f"LaidOutPosition({self.layout})"


def saved_layout(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The layout a batch iterator's position was saved with, and the position of its batches.
    A position from before `LaidOutPosition` is the batches' alone: Grain's `mp_prefetch`
    interleaves one iterator per worker, any other position is the packer's own (concat's has a
    `record`, first_fit's a `next_row`); its reader is not told."""
    if "batches" in state and "workers" in state:
        layout = {key: state[key] for key in ("workers", "packing", "reader") if key in state}
        return layout, state["batches"]
    workers = len(state.get("iterators_in_use_states", ()))
    packer = state["iterators_in_use_states"][0] if workers else state
    layout = {"workers": workers}
    if isinstance(packer, dict) and "record" in packer:
        layout["packing"] = "concat"
    elif isinstance(packer, dict) and "next_row" in packer:
        layout["packing"] = "first_fit"
    return layout, state


def layout_changed(key: str, saved: Any, now: Any) -> str:
    """The line refusing a position saved with `key`=`saved` in a run with `now`."""
    if key == "reader":
        return (
            f"the checkpoint's data position was saved reading {READ_DATA.get(saved, saved)} and "
            f"does not carry over to {READ_DATA.get(now, now)}; resume with the data and reader "
            f"it was saved with, or {NEW_RUN}"
        )
    why = " (each worker packs its own share of the data)" if key == "workers" else ""
    return (
        f"the checkpoint's data position was saved with data.{key}={saved} and does not carry "
        f"over to data.{key}={now}{why}; set data.{key}={saved} to resume this run, or {NEW_RUN}"
    )


def check_packing(
    info: DatasetInfo,
    seq_len: int,
    batch_size: int,
    packing: str,
    max_docs_per_row: int | None,
    concat_offset: str,
) -> None:
    """One-line errors for packing arguments the chain cannot honour (`check_rows`: the rows'
    shape, as either packer needs it)."""
    check_rows(seq_len, batch_size, max_docs_per_row)
    if packing not in PACKING_MODES:
        raise DataError(f"data.packing={packing!r} is unknown; use one of {PACKING_MODES}")
    if concat_offset not in CONCAT_OFFSETS:
        raise DataError(
            f"data.concat_offset={concat_offset!r} is unknown; use one of {CONCAT_OFFSETS}"
        )
    if concat_offset != "none" and (packing != "concat" or info.format != "arrayrecord"):
        raise DataError(
            f"data.concat_offset={concat_offset} needs data.packing=concat over an ArrayRecord "
            f"dataset (this is packing={packing}, {info.path} is {info.format}); "
            "use data.concat_offset=none"
        )
