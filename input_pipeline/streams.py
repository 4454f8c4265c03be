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

Batch = dict[str, np.ndarray]
OpenStream = Callable[[int, int], Iterator[Batch]]  # (stream index, stream count) -> batches
# The way out of a data position that does not fit the run.
NEW_RUN = "start a new run.workdir whose checkpoint.init_from is this one (it keeps the weights)"


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


def is_stream_state(state: Any) -> bool:
    return isinstance(state, dict) and "streams" in state and "positions" in state


def position_mismatch(saved: Any, fresh: Any, path: str = "position") -> str | None:
    """Where a saved data position is not laid out like `fresh`, the state of a fresh iterator of
    this run's pipeline: the first place whose kind, keys or length differ (None: it fits), so a
    position this pipeline cannot take is refused before Grain's own code fails on it. An empty
    mapping in `fresh` takes any mapping (Grain keeps prefetched iterators' states in one)."""
    if isinstance(fresh, dict):
        if not isinstance(saved, dict):
            return f"{path} is {_kind(saved)}, not a mapping"
        if not fresh:
            return None
        keys = sorted(str(key) for key in fresh)
        if sorted(saved) != keys:
            return f"{path} has keys {sorted(saved)}, not {keys}"
        mismatches = (position_mismatch(saved[str(k)], v, f"{path}.{k}") for k, v in fresh.items())
        return next((m for m in mismatches if m is not None), None)
    if isinstance(fresh, list | tuple):
        if not isinstance(saved, list | tuple):
            return f"{path} is {_kind(saved)}, not a list"
        if len(saved) != len(fresh):
            return f"{path} has {len(saved)} entries, not {len(fresh)}"
        mismatches = (
            position_mismatch(s, f, f"{path}[{i}]")
            for i, (s, f) in enumerate(zip(saved, fresh, strict=True))
        )
        return next((m for m in mismatches if m is not None), None)
    if not _same_kind(saved, fresh):
        return f"{path} is {_kind(saved)}, not {_kind(fresh)}"
    return None


# A saved value's kind, in `position_mismatch`'s words (bool before int: a bool is an int)
KINDS = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
    (type(None), "null"),
    (dict, "a mapping"),
    (list | tuple, "a list"),
)


def _kind(value: Any) -> str:
    return next((name for kind, name in KINDS if isinstance(value, kind)), type(value).__name__)


def _same_kind(saved: Any, fresh: Any) -> bool:
    """Whether a saved leaf is of the fresh one's kind; a whole number where a float is kept
    counts as one (a file edited by hand may drop the `.0`)."""
    return _kind(saved) == _kind(fresh) or (
        isinstance(fresh, float) and _kind(saved) == "an integer"
    )


def check_position(saved: Any, fresh: Any, path: str = "position") -> None:
    """A one-line `DataError` when `saved` is not laid out like `fresh` (`position_mismatch`)."""
    if (mismatch := position_mismatch(saved, fresh, path)) is not None:
        raise not_this_pipelines(mismatch)


class PositionMismatchError(DataError):
    """A saved data position that this run's pipeline would not have written: its settings, or
    the file, changed since."""


def not_this_pipelines(mismatch: str) -> PositionMismatchError:
    """The line refusing a saved data position this run's pipeline cannot take, and why."""
    return PositionMismatchError(
        f"the checkpoint's data position does not fit this run's data pipeline ({mismatch}); "
        f"resume with the data settings it was saved with, or {NEW_RUN}"
    )


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


def check_stream_state(state: dict[str, Any]) -> None:
    """A one-line `DataError` unless `state` is laid out as `StreamBatches.get_state()` makes
    it: a stream count of at least 1, and a mapping of positions."""
    check_position(state, {"streams": 1, "positions": {}})
    if state["streams"] < 1:
        raise not_this_pipelines(f"position.streams is {state['streams']}, not a count above 0")


def close_readers(iterator: Any) -> None:
    """Stop the readers behind one of our pipeline's batch iterators: a stream or mixture of ours
    (`close_readers`), or the Grain iterator of one dataset (`close`)."""
    if hasattr(iterator, "close_readers"):
        iterator.close_readers()
    elif isinstance(iterator, grain.DatasetIterator):
        iterator.close()
