"""A Grain worker's share of a stream, and how it ends its reads when all of that share is
unreadable (`data.skip_corrupt`): unshuffled, worker i of W reads only every W-th read (or
shard), so one worker can meet nothing but damaged data while others read on. Both readers use
it: ArrayRecord records (`UnreadableRecords`) and TFRecord shards (`tfrecords.EmptyShards`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import grain
import numpy as np

from input_pipeline.errors import DataError


def worker_share(host_records: int, per_read: int, workers: int, shuffle: bool) -> int:
    """How many of a stream's `host_records` one of `workers` Grain workers ever reads: worker
    i takes reads i, i+W, ..., so unshuffled it meets reads starting at i*per_read plus multiples
    of gcd(W*per_read, host_records) only; that leaves gaps when the step exceeds per_read (e.g.
    W*per_read a multiple of host_records: the same records forever). Shuffled, a new order every
    epoch brings every record to every worker."""
    if shuffle or workers < 2 or not host_records:
        return host_records
    step = math.gcd(workers * per_read, host_records)
    return host_records if per_read >= step else host_records // step * per_read


class UnreadableRecords:
    """A stream's records found unreadable while none has been readable yet: with
    `data.skip_corrupt` a stream whose every record is unreadable would skip them forever, so
    that is a `DataError`. Only reads that return no record are looked at (a bit per record,
    dropped at the first readable one), so a healthy stream pays one flag per read.

    A Grain worker that can reach only `share` of the `num_records` (`worker_share`) decides on
    those: once all are unreadable it checks the rest once, and either ends its reads (another
    worker reads the readable ones) or raises the same `DataError`."""

    def __init__(self, num_records: int, name: str, share: int):
        self.num_records, self.name, self.share = num_records, name, share
        self.readable = False
        self.share_unreadable = False  # every record this worker reaches is, others are not
        self._seen: np.ndarray | None = None  # one bit per record found unreadable
        self._count = 0
        self._lock = threading.Lock()  # read threads share this

    def add(self, records: np.ndarray, any_readable: Callable[[np.ndarray], bool]) -> bool:
        """Note `records` (a read that returned none) as unreadable; True once this worker's
        whole share is, while `any_readable(the other records)` says another worker has some."""
        if self.readable or not len(records):
            return False
        with self._lock:
            if self.share_unreadable:
                return True
            if self._seen is None:
                self._seen = np.zeros((self.num_records + 7) // 8, np.uint8)
            unique = np.unique(records)
            byte, bit = unique >> 3, (unique & 7).astype(np.uint8)
            fresh = (self._seen[byte] >> bit) & 1 == 0
            np.bitwise_or.at(self._seen, byte[fresh], np.left_shift(1, bit[fresh], dtype=np.uint8))
            self._count += int(fresh.sum())
            if self._count < self.share:
                return False
            others = np.flatnonzero(np.unpackbits(self._seen, bitorder="little") == 0)
            others = others[others < self.num_records]
            if not len(others) or not any_readable(others):
                raise DataError(
                    f"none of the {self.num_records} records of {self.name} is readable: "
                    "data.skip_corrupt=true skipped every one, so there is nothing to read; "
                    "restore the shards or re-run python -m input_pipeline.prepare --overwrite"
                )
            self.share_unreadable = True
            return True

    def __getstate__(self) -> dict:  # worker processes keep their own count
        return {**self.__dict__, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class ShareUnreadable:
    """What `ReadRecords.map` returns once every record its Grain worker can reach is unreadable
    and another worker's is not. Not None: Grain drops None elements and reads on."""


class EndOfShare(grain.IterDataset):
    """A Grain worker's reads, ended at the first `ShareUnreadable`: the workers' interleave then
    goes on with the other workers instead of waiting forever on this one. Its state is its
    parent's."""

    def __iter__(self) -> grain.DatasetIterator:
        return EndOfShareIterator(self._parent.__iter__())

    def __str__(self) -> str:
        return "EndOfShare"


class EndOfShareIterator(grain.DatasetIterator):
    """`EndOfShare`'s iterator: one type check per read."""

    def __next__(self) -> list[dict[str, np.ndarray]]:
        element = next(self._parent)
        if isinstance(element, ShareUnreadable):
            raise StopIteration
        return element

    def get_state(self) -> dict:
        return self._parent.get_state()

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state)
