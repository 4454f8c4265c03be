"""A global batch made of independent input streams, so batches do not depend on the host count.

Stream `s` of `S` reads records `s::S` and yields `global_batch_size / S` rows per batch; the
global batch is every stream's rows in stream order. Process `p` of `n` owns the contiguous streams
`p*S/n .. (p+1)*S/n - 1` and hands their rows, concatenated, to
`jax.make_array_from_process_local_data` (which places process `p`'s rows after process `p-1`'s).
So 1 process x 8 devices and 2 processes x 4 devices train on identical batches when `S` is
fixed, and a checkpoint holds one position per stream, which any process count can resume from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np

from input_pipeline.errors import DataError
from input_pipeline.positions import check_position, check_stream_state, is_stream_state

Batch = dict[str, np.ndarray]
OpenStream = Callable[[int, int], Iterator[Batch]]  # (stream index, stream count) -> batches


def owned_streams(streams: int, process_index: int, process_count: int) -> range:
    """The streams process `process_index` reads; a one-line error when they do not split."""
    if streams % process_count:
        raise DataError(
            f"{streams} data streams do not split over {process_count} processes; set "
            f"data.streams to a multiple of {process_count} (or run on a process count that "
            f"divides {streams})"
        )
    per_process = streams // process_count
    return range(process_index * per_process, (process_index + 1) * per_process)


class StreamBatches:
    """This process's rows of every global batch, with a checkpointable position per stream.

    Streams open lazily, so `set_state` from a checkpoint written with another stream count
    (when `data.streams` is unset) reopens them without first starting readers twice.
    `pad_exhausted` (eval): a finished stream yields zero-weight rows forever, so every process
    runs the same number of steps and a padded row changes no sum; a stream with no records at
    all (a split smaller than the stream count) yields `blank(streams)` from the start.

    Kept over Grain's `ElasticIterator`, which re-shards only an unpacked `MapDataset`.
    """

    def __init__(
        self,
        open_stream: OpenStream,
        streams: int,
        process_index: int,
        process_count: int,
        *,
        pinned: bool = True,
        pad_exhausted: bool = False,
        blank: Callable[[int], Batch] | None = None,
    ):
        self._open_stream = open_stream
        self._process = (process_index, process_count)
        self._pinned = pinned
        self._pad_exhausted = pad_exhausted
        self._blank = blank
        self._set_streams(streams)

    def _set_streams(self, streams: int) -> None:
        self.streams = streams
        self.owned = owned_streams(streams, *self._process)
        self._iterators: dict[int, Iterator[Batch]] | None = None
        self._last: dict[int, Batch] = {}  # each stream's latest batch: the padding's shape
        self._padding: dict[int, Batch] = {}

    def _open(self) -> dict[int, Iterator[Batch]]:
        if self._iterators is None:
            self._iterators = {s: self._open_stream(s, self.streams) for s in self.owned}
        return self._iterators

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> Batch:
        parts = [self._next_of(s, it) for s, it in self._open().items()]
        if len(parts) == 1:
            return parts[0]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def _next_of(self, stream: int, iterator: Iterator[Batch]) -> Batch:
        if stream in self._padding:
            return self._padding[stream]
        try:
            batch = next(iterator)
        except StopIteration:
            if not self._pad_exhausted:
                raise
            if stream in self._last:
                last = self._last.pop(stream)
                self._padding[stream] = {name: np.zeros_like(v) for name, v in last.items()}
            elif self._blank is not None:
                self._padding[stream] = self._blank(self.streams)
            else:
                raise DataError(f"data stream {stream} of {self.streams} yields no batch") from None
            return self._padding[stream]
        if self._pad_exhausted:
            self._last[stream] = batch
        return batch

    def close_readers(self) -> None:
        """Stop the open streams' readers (Grain worker processes) now, in this thread."""
        for iterator in (self._iterators or {}).values():
            close_readers(iterator)

    def get_state(self) -> dict[str, Any]:
        positions = {str(s): it.get_state() for s, it in self._open().items()}
        return {"streams": self.streams, "positions": positions}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from `get_state()` of this process, or the merged states of all processes."""
        if not is_stream_state(state):  # a checkpoint from before streams: one per process
            state = {"streams": self._process[1], "positions": {str(self._process[0]): state}}
        check_stream_state(state)
        if state["streams"] != self.streams:
            if self._pinned:
                raise DataError(
                    f"data.streams={self.streams} but the checkpoint's data position has "
                    f"{state['streams']} streams; set data.streams={state['streams']} (or unset "
                    "it) to resume this run"
                )
            saved, processes = state["streams"], self._process[1]
            if saved % processes:  # data.streams cannot help: the checkpoint fixed the count
                raise DataError(
                    f"the checkpoint's data position has {saved} data streams, which do not "
                    f"split over {processes} processes; resume on a process count that divides "
                    f"{saved} (a new run keeps any process count that divides its data.streams)"
                )
            self._set_streams(saved)
        missing = [s for s in self.owned if str(s) not in state["positions"]]
        if missing:
            raise DataError(
                f"the checkpoint's data position lacks streams {missing}; resume with the "
                "process count that wrote it"
            )
        for s in self.owned:  # each stream's iterator checks the rest of its own position
            check_position(state["positions"][str(s)], {}, f"position.positions.{s}")
        for s, iterator in self._open().items():
            iterator.set_state(state["positions"][str(s)])


def close_readers(iterator: Any) -> None:
    """Stop the readers behind one of our pipeline's batch iterators: a stream or mixture of ours
    (`close_readers`), or the Grain iterator of one dataset (`close`)."""
    if hasattr(iterator, "close_readers"):
        iterator.close_readers()
    elif isinstance(iterator, grain.DatasetIterator):
        iterator.close()
