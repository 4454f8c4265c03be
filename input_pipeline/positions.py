"""Whether a saved data position is one this pipeline can resume from, asked before it reads."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from input_pipeline.errors import DataError

# The way out of a data position that does not fit the run.
NEW_RUN = "start a new run.workdir whose checkpoint.init_from is this one (it keeps the weights)"


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


def check_stream_state(state: dict[str, Any]) -> None:
    """A one-line `DataError` unless `state` is laid out as `StreamBatches.get_state()` makes
    it: a stream count of at least 1, and a mapping of positions."""
    check_position(state, {"streams": 1, "positions": {}})
    if state["streams"] < 1:
        raise not_this_pipelines(f"position.streams is {state['streams']}, not a count above 0")


class DamagedPositionError(DataError):
    """A saved data position laid out as this pipeline writes it, holding a value no run of ours
    writes: the file was edited or damaged since it was saved."""


def position_damage(position: Any, path: str = "position") -> str | None:
    """The first value in a saved data position that no run of ours writes (None: none found),
    so a damaged file is refused before Grain resumes elsewhere from it, or fails inside on it.
    Every number in a position counts or indexes something (streams, reads, records, offsets,
    rows, tokens, workers), so none is negative or infinite; a stream is one of the position's
    `streams`; Grain's interleave (of shards, or of `data.workers`) points inside its own lists;
    no integer passes Grain's largest index (`MAX_COUNT`); a mixture gave each of its rows once.
    Reads only the position: its layout is `position_mismatch`'s to check, and bounds only the
    pipeline knows are `check_within`'s."""
    return next(_damages(position, path), None)


def check_undamaged(position: Any) -> None:
    """A `DamagedPositionError` naming the first value of `position` no run of ours writes."""
    if (damage := position_damage(position)) is not None:
        raise DamagedPositionError(damage)


def _damages(node: Any, path: str) -> Iterator[str]:
    if isinstance(node, bool) or node is None or isinstance(node, str):
        return
    if isinstance(node, int | float):
        if not math.isfinite(node) or node < 0:
            yield f"{path} is {node}, not a count of 0 or more"
        elif isinstance(node, int) and node > MAX_COUNT:
            yield f"{path} is {node}, past the largest count a run keeps ({MAX_COUNT})"
        return
    if isinstance(node, list | tuple):
        for i, item in enumerate(node):
            yield from _damages(item, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    if is_mixture(node):
        yield from _mixture_damages(node, path)
    for key, value in node.items():
        if is_mixture(node) and key == "sources" and isinstance(value, dict):
            yield from _source_damages(value, f"{path}.{key}")
        else:
            yield from _damages(value, f"{path}.{key}")
    if is_stream_state(node):
        yield from _unknown_streams(node, path)
    if _is_interleave(node):
        yield from _interleave_damages(node, path)
    if node.keys() == {"parent", "next_row", "counter"}:
        yield from _first_fit_damages(node, path)
    if _is_count(workers := node.get("workers")) and workers and "batches" in node:
        yield from _worker_damages(node["batches"], workers, f"{path}.batches")


# Grain's largest index (a dataset's length, `sys.maxsize` for reads repeated forever); every
# count in a position is an index or a 64-bit number, so a larger one was never written.
MAX_COUNT = sys.maxsize


def _mixture_damages(mixture: dict[str, Any], path: str) -> Iterator[str]:
    """A mixture hands out each row from one source: the rows its sources gave (`taken`) add up
    to the rows it handed out (`row`). Neither has a bound: reads repeat forever."""
    row, taken = mixture["row"], mixture.get("taken")
    if not (_is_count(row) and isinstance(taken, dict) and all(map(_is_count, taken.values()))):
        return
    if sum(taken.values()) != row:
        yield f"{path}.row is {row}, not the {sum(taken.values())} rows its sources gave (taken)"


def is_mixture(position: dict[str, Any]) -> bool:
    """Whether a stream's position is a mixture's (`input_pipeline.mixture.MixedStream`)."""
    return "sources" in position and "row" in position


def _source_damages(sources: dict[str, Any], path: str) -> Iterator[str]:
    """A mixture's sources: each one's `used` rows of its batch in hand is -1 when none is in
    hand, its position and every other number a count."""
    for name, source in sources.items():
        if isinstance(source, dict) and source.get("used") == NOTHING_IN_HAND:
            source = {key: value for key, value in source.items() if key != "used"}
        yield from _damages(source, f"{path}.{name}")


NOTHING_IN_HAND = -1  # a mixture source's `used` when it holds no batch


def _unknown_streams(state: dict[str, Any], path: str) -> Iterator[str]:
    """Positions of streams that are not among the state's `streams`."""
    streams, positions = state["streams"], state["positions"]
    if not _is_count(streams) or not isinstance(positions, dict):
        return
    for key in positions:
        if not (isinstance(key, str) and key.isdecimal() and int(key) < streams):
            yield f"{path}.positions has a stream {key!r}, not one of 0..{streams - 1}"


# The keys of the state of Grain's interleave: shards read at once, or `data.workers` workers
INTERLEAVE = ("next_index_in_cycle", "next_index_in_datasets", "iterators_in_use_indices")


def _is_interleave(node: dict[str, Any]) -> bool:
    return all(key in node for key in INTERLEAVE) and isinstance(
        node["iterators_in_use_indices"], list
    )


def _interleave_damages(state: dict[str, Any], path: str) -> Iterator[str]:
    """Grain's interleave takes its datasets in order into a cycle of iterators: the next one in
    the cycle is one of them, each in use was taken before the next to take, and each is
    exhausted (1) or not (0)."""
    in_use, cycle = state["iterators_in_use_indices"], state["next_index_in_cycle"]
    taken = state["next_index_in_datasets"]
    if in_use and _is_count(cycle) and cycle >= len(in_use):
        yield f"{path}.next_index_in_cycle is {cycle}, past its {len(in_use)} iterators in use"
    for i, index in enumerate(in_use):
        if _is_count(index) and _is_count(taken) and index >= taken:
            yield (
                f"{path}.iterators_in_use_indices[{i}] is {index}, not below "
                f"next_index_in_datasets ({taken})"
            )
    flags = state.get("exhausted")
    for i, flag in enumerate(flags if isinstance(flags, list) else []):
        if _is_count(flag) and flag > 1:
            yield f"{path}.exhausted[{i}] is {flag}, not 0 or 1"


def _worker_damages(batches: Any, workers: int, path: str) -> Iterator[str]:
    """With `data.workers` Grain workers, the batches' position is Grain's interleave of one
    iterator per worker: it takes no more than `workers` of them."""
    if not (isinstance(batches, dict) and _is_interleave(batches)):
        return
    taken = batches["next_index_in_datasets"]
    if _is_count(taken) and taken > workers:
        yield f"{path}.next_index_in_datasets is {taken}, past its {workers} workers"


def _first_fit_damages(state: dict[str, Any], path: str) -> Iterator[str]:
    """Grain's first_fit packer counts every row it emitted (`counter`), those of the batch in
    hand (`next_row`) among them."""
    row, counter = state["next_row"], state["counter"]
    if _is_count(row) and _is_count(counter) and row > counter:
        yield f"{path}.next_row is {row}, past the {counter} rows emitted (its counter)"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_within(position: Any, bounds: Mapping[str, int], path: str = "position") -> None:
    """A `DamagedPositionError` for the first value of a key in `bounds` above its bound, where
    the bound is one only the pipeline knows (a shuffle window's length; a shard's size is its
    reader's to check): a value past it would be read as the end of it, and resume elsewhere in
    silence."""
    if (damage := next(_past_bounds(position, bounds, path), None)) is not None:
        raise DamagedPositionError(damage)


def _past_bounds(node: Any, bounds: Mapping[str, int], path: str) -> Iterator[str]:
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _past_bounds(item, bounds, f"{path}[{i}]")
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in bounds and _is_count(value) and value > bounds[key]:
            yield f"{path}.{key} is {value}, past the {bounds[key]} {BOUNDED.get(key, key)}"
        yield from _past_bounds(value, bounds, f"{path}.{key}")


# What each bounded value of `check_within` counts in, in its line's words
BOUNDED = {
    "pos_in_window": "records of its shuffle window",
}
