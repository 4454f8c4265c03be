"""A data mixture: one stream's rows drawn from several sources in proportion to their weights.

Row `n` of the stream comes from the source furthest behind its share (`weight * (n + 1)` rows
minus the rows it gave; ties go to the earlier source), so the shares are exact to one row at
every point and the order is the same on every run. Each source is its own packed batch
iterator; the mixture keeps one batch of each in hand and hands out its rows one at a time. The
state is every source's position (where its batch in hand was read, and how many of its rows
were used), the row count, and the tokens each source gave: a resume continues bit-exactly.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from input_pipeline.device import in_own_memory
from input_pipeline.errors import DataError
from input_pipeline.positions import NEW_RUN, check_position
from input_pipeline.streams import close_readers

Batch = dict[str, np.ndarray]


def rows_per_read(weight: float, rows: int) -> int:
    """Rows per batch of a source's own iterator: about its share of one mixed batch."""
    return max(1, math.ceil(weight * rows))


def mixed(iterators: dict[str, Any], weights: dict[str, float], rows: int) -> Any:
    """A `MixedStream`; a mixture of one is its source's iterator, its batches and state as is."""
    if len(iterators) == 1:
        return next(iter(iterators.values()))
    return MixedStream(iterators, weights, rows)


class MixedStream:
    """`rows` rows per batch from `iterators` (name -> checkpointable batch iterator) by weight.

    Kept over Grain's `IterDataset.mix`, which mixes whole elements and counts no tokens per
    source: this mixes rows, exact to one row, and checkpoints `tokens_<name>`."""

    def __init__(self, iterators: dict[str, Any], weights: dict[str, float], rows: int):
        total = sum(weights.values())
        self.names = list(iterators)
        self.iterators = iterators
        self.shares = np.array([weights[n] / total for n in self.names])
        self.rows = rows
        self.row = 0  # rows handed out so far
        self.taken = np.zeros(len(self.names), np.int64)
        self.tokens = dict.fromkeys(self.names, 0.0)  # tokens (weight > 0) each source gave
        self._in_hand: dict[str, Batch | None] = dict.fromkeys(self.names)
        self._used = dict.fromkeys(self.names, 0)
        self._read_at = {n: None for n in self.names}  # position its batch in hand was read at

    def close_readers(self) -> None:
        """Stop the sources' Grain readers now, in this thread."""
        for iterator in self.iterators.values():
            close_readers(iterator)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def _next_batch(self, name: str) -> Batch:
        """Source `name`'s next batch, in this process's memory: a batch of Grain worker
        processes lies in shared memory, which Grain unlinks once the batch is dropped, and the
        batch in hand is dropped only at the exit (Python's resource tracker then warned of
        "leaked shared_memory objects" after the run's last line)."""
        batch = next(self.iterators[name])
        return {key: in_own_memory(np.asarray(value)) for key, value in batch.items()}

    def _take_row(self, name: str) -> dict[str, np.ndarray]:
        batch = self._in_hand[name]
        if batch is None or self._used[name] == len(batch["inputs"]):
            self._read_at[name] = copy.deepcopy(self.iterators[name].get_state())
            batch = self._in_hand[name] = self._next_batch(name)
            self._used[name] = 0
        row = {k: v[self._used[name]] for k, v in batch.items()}
        self._used[name] += 1
        return row

    def __next__(self) -> Batch:
        rows = []
        for _ in range(self.rows):
            behind = self.shares * (self.row + 1) - self.taken
            source = int(np.argmax(behind))  # first maximum: ties go to the earlier source
            name = self.names[source]
            row = self._take_row(name)
            self.taken[source] += 1
            self.row += 1
            self.tokens[name] += float(row["weights"].sum()) if "weights" in row else 0.0
            rows.append(row)
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def get_state(self) -> dict[str, Any]:
        sources = {}
        for name in self.names:
            held = self._in_hand[name] is not None
            position = self._read_at[name] if held else self.iterators[name].get_state()
            sources[name] = {"position": position, "used": self._used[name] if held else -1}
        return {
            "row": self.row,
            "taken": {n: int(t) for n, t in zip(self.names, self.taken, strict=True)},
            "tokens": dict(self.tokens),
            "sources": sources,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from `get_state()`; a position of other sources, or not laid out as a mixture's,
        is one line before anything moves. A source whose batch size changed since (another
        `data.global_batch_size` or other weights) resumes at the same row of its own stream."""
        sources = mixture_sources(state)
        if sources is None:
            raise DataError(
                f"the checkpoint's data position is of one dataset, but data.mixture names "
                f"{sorted(self.names)}; resume with the data.path it was saved with, or {NEW_RUN}"
            )
        if sources != sorted(self.names):
            raise DataError(
                f"the checkpoint's data position is a mixture of {sources}, but "
                f"data.mixture names {sorted(self.names)}; resume with the sources (and names) "
                f"it was saved with, or {NEW_RUN}"
            )
        check_position(_own_part(state), _own_part(self.get_state()))
        for name in self.names:  # first: a source may refuse it (`LaidOutPosition`)
            self.iterators[name].set_state(state["sources"][name]["position"])
        for name in self.names:
            self._take_back_batch_in_hand(name, state["sources"][name])
        self.row = int(state["row"])
        self.taken = np.array([state["taken"][n] for n in self.names], np.int64)
        self.tokens = {n: float(state["tokens"][n]) for n in self.names}

    def _take_back_batch_in_hand(self, name: str, saved: dict[str, Any]) -> None:
        """Re-read the batch source `name` had in hand (its iterator is at `saved["position"]`)
        and skip its used rows; those may reach past a batch that is now smaller, whose rows are
        the same rows of the source's stream (concat packing cuts rows before it batches)."""
        self._in_hand[name], self._used[name] = None, 0
        used = int(saved["used"])
        if used < 0:  # nothing was in hand
            return
        self._read_at[name] = copy.deepcopy(saved["position"])
        batch = self._next_batch(name)
        while used >= len(batch["inputs"]):
            used -= len(batch["inputs"])
            self._read_at[name] = copy.deepcopy(self.iterators[name].get_state())
            batch = self._next_batch(name)
        self._in_hand[name], self._used[name] = batch, used


def _own_part(state: dict[str, Any]) -> dict[str, Any]:
    """A mixture's position with its sources' positions blanked: each source's iterator checks
    its own (`LaidOutPosition` names another layout in its own words)."""
    sources = state.get("sources")
    if not isinstance(sources, dict):
        return state
    blank = {
        name: {**source, "position": None}
        if isinstance(source, dict) and "position" in source
        else source
        for name, source in sources.items()
    }
    return {**state, "sources": blank}


def mixture_sources(position: Any) -> list[str] | None:
    """The source names of a `MixedStream`'s saved position; None for one dataset's."""
    if isinstance(position, dict) and "sources" in position and "row" in position:
        return sorted(position["sources"])
    return None


def tokens_by_source(data_state: Any) -> dict[str, float]:
    """`tokens_<name>`: the tokens each source gave this process's streams, from a
    `StreamBatches` state of mixed streams."""
    totals: dict[str, float] = {}
    for position in (data_state or {}).get("positions", {}).values():
        for name, tokens in position.get("tokens", {}).items():
            totals[f"tokens_{name}"] = totals.get(f"tokens_{name}", 0.0) + tokens
    return totals
