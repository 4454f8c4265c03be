"""`Reading`: how one reader takes records from a split, whatever the shard format."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Reading:
    """Order, passes, parallelism, this reader's share, and what to do with damaged records;
    one object, so the ArrayRecord and TFRecord readers and their callers agree on it."""

    shuffle: bool = True  # seeded global shuffle, a new order every epoch
    seed: int = 0
    num_epochs: int | None = None  # None: repeat forever
    read_threads: int = 4
    workers: int = 0  # Grain worker processes after batching
    process_index: int = 0  # this reader's share: records (or TFRecord shards) index::count
    process_count: int = 1
    skip_corrupt: bool = False  # drop unreadable records, listing them in `skip_log`
    skip_log: Path | None = None
    reader: str = "auto"  # TFRecord: auto/grain (Grain's reader) or tfdata (tf.data)
