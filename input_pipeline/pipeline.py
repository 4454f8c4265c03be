"""The one Grain chain, reading like the data flow:

per-host split -> seeded global shuffle (new order every epoch) -> repeat -> decode -> pack to
seq_len -> batch (this host's share) -> batch contract -> optional worker processes.

Batch contract: `inputs`, `targets`, `segment_ids`, `positions` int32 `[B, L]`, `weights` float32
`[B, L]` (0 on padding). Segment ids restart at 1 per row, 0 marks padding.
"""

from __future__ import annotations

from pathlib import Path

import grain
import numpy as np

from input_pipeline.dataset_info import DatasetInfo
from input_pipeline.errors import DataError
from input_pipeline.records import CheckedSource, DecodeRecord

PACKING_MODES = ("concat", "first_fit")
FEATURES = ("inputs", "targets")


class Readable(grain.transforms.Filter):
    """Drops the records `CheckedSource` could not read (`data.skip_corrupt`)."""

    def filter(self, record: bytes | None) -> bool:
        return record is not None


class ToBatchContract(grain.transforms.Map):
    """Grain's packed feature names -> the trainer's batch dict."""

    def map(self, packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        segment_ids = packed["inputs_segment_ids"].astype(np.int32)
        return {
            "inputs": packed["inputs"].astype(np.int32),
            "targets": packed["targets"].astype(np.int32),
            "segment_ids": segment_ids,
            "positions": packed["inputs_positions"].astype(np.int32),
            "weights": (segment_ids > 0).astype(np.float32),
        }


class SplitToLength(grain.experimental.FlatMapTransform):
    """first_fit packs whole pieces: cut records longer than a row into row-sized pieces."""

    def __init__(self, seq_len: int, max_record_tokens: int):
        self.seq_len = seq_len
        self.max_fan_out = max(1, -(-max_record_tokens // seq_len))

    def flat_map(self, element: dict[str, np.ndarray]):
        length = len(element["inputs"])
        return [
            {k: v[start : start + self.seq_len] for k, v in element.items()}
            for start in range(0, length, self.seq_len)
        ]


class PadBatch(grain.transforms.Map):
    """Pad a short final batch with zero-weight rows: every eval token counts once, and the
    batch keeps the shape the step was compiled for."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    def map(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = self.batch_size - len(batch["inputs"])
        if missing <= 0:
            return batch
        return {
            k: np.concatenate([v, np.zeros((missing, *v.shape[1:]), v.dtype)])
            for k, v in batch.items()
        }


def make_batch_iterator(
    info: DatasetInfo,
    split: str,
    *,
    seq_len: int,
    batch_size: int,
    packing: str = "concat",
    shuffle: bool = True,
    seed: int = 0,
    num_epochs: int | None = None,
    read_threads: int = 4,
    workers: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    skip_corrupt: bool = False,
    skip_log: Path | None = None,
) -> grain.DatasetIterator:
    """This host's batches of `split`; the iterator's state checkpoints its exact position.
    With `skip_corrupt`, unreadable records are dropped and listed in `skip_log`."""
    if seq_len < 2 or batch_size < 1:
        raise DataError(f"data.seq_len={seq_len} and batch size {batch_size} must be >= 2 and >= 1")
    if packing not in PACKING_MODES:
        raise DataError(f"data.packing={packing!r} is unknown; use one of {PACKING_MODES}")
    shards = info.split(split)["shards"]
    source = CheckedSource(
        info.shard_paths(split),
        [s["records"] for s in shards],
        skip_corrupt=skip_corrupt,
        skip_log=skip_log,
    )
    records = grain.MapDataset.source(source)[process_index::process_count]
    if len(records) == 0:
        raise DataError(f"{info.path} {split} split has no records for host {process_index}")
    if shuffle:
        records = records.shuffle(seed=seed)
    records = records.repeat(num_epochs)
    if skip_corrupt:
        records = records.filter(Readable())
    records = records.map(DecodeRecord(info.token_dtype))
    pairs = records.to_iter_dataset(
        grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=max(64, 4 * batch_size))
    )
    lengths = {name: seq_len for name in FEATURES}
    if packing == "concat":
        rows = grain.experimental.ConcatThenSplitIterDataset(pairs, length_struct=lengths)
    else:
        max_record = int(info.raw.get("max_record_tokens", seq_len))
        pieces = grain.experimental.FlatMapIterDataset(pairs, SplitToLength(seq_len, max_record))
        rows = grain.experimental.FirstFitPackIterDataset(
            pieces,
            length_struct=lengths,
            num_packing_bins=batch_size,
            seed=seed,
            shuffle_bins=shuffle,
        )
    batches = rows.map(ToBatchContract()).batch(batch_size, drop_remainder=False)
    batches = batches.map(PadBatch(batch_size))
    if workers > 0:
        batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iter(batches)
