"""A caller's batches (`trainer.run(data=...)`), checked at the boundary as they pass: a dict of
arrays whose fields share a leading batch axis, and an iterator position a checkpoint's JSON can
hold; a mistake is one line at its first batch, not an error in the device transfer."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from input_pipeline.errors import DataError
from input_pipeline.streams import close_readers
from trainer.errors import ConfigError

# The key under which a checkpoint holds a caller's iterator position of bytes, in base64.
BYTES_POSITION = "bytes_base64"


class BatchDicts:
    """A caller's batches, each checked to be a dict of arrays as it passes (a tuple or a bare
    array would fail deep in the device transfer); anything else (a Grain iterator's
    `get_state`/`set_state`) goes to the iterator, and closing it closes its readers."""

    def __init__(self, batches: Iterable[Any], name: str):
        self._batches = iter(batches)
        self._name = name

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        batch = next(self._batches)
        if not isinstance(batch, Mapping):
            raise DataError(
                f"{self._name} yielded {_described(batch)}, not a batch dict; yield dicts of "
                "arrays with a leading batch axis, e.g. {'x': x[i:i + 32], 'y': y[i:i + 32]}"
            )
        _check_rows(batch, self._name)
        return batch

    def close_readers(self) -> None:
        close_readers(self._batches)

    def __getattr__(self, name: str) -> Any:
        if name in ("_batches", "_name"):  # not set yet (a copy): no recursion into this
            raise AttributeError(name)
        attribute = getattr(self._batches, name)
        if name == "get_state":  # a checkpoint holds the position as JSON
            return lambda: _position_as_json(attribute(), self._name)
        if name == "set_state":
            return lambda position: attribute(_position_from_json(position))
        return attribute


def _position_as_json(position: Any, name: str) -> Any:
    """A caller's iterator position as the JSON a checkpoint holds: bytes (`grain.DataLoader`'s)
    in base64; anything else JSON cannot hold is one line here, not a traceback from the
    checkpoint's writer thread."""
    if isinstance(position, bytes):
        return {BYTES_POSITION: base64.b64encode(position).decode("ascii")}
    try:
        json.dumps(position)
    except (TypeError, ValueError) as err:
        raise DataError(
            f"{name}'s get_state() returned a position a checkpoint cannot hold ({err}); return "
            "bytes, or JSON values (dicts, lists, str, int, float)"
        ) from None
    return position


def _position_from_json(position: Any) -> Any:
    """A position as its iterator's `get_state` returned it (`_position_as_json` undone)."""
    if isinstance(position, dict) and set(position) == {BYTES_POSITION}:
        return base64.b64decode(position[BYTES_POSITION])
    return position


def _check_rows(batch: Mapping[str, Any], name: str) -> None:
    """Every field of a batch has the same leading batch axis: a scalar field is one example's
    (an unbatched dataset), and fields of other row counts would be split over the devices
    each its own way."""
    rows = {key: np.shape(value)[:1] for key, value in batch.items()}
    if scalars := sorted(key for key, shape in rows.items() if not shape):
        raise DataError(
            f"{name} yielded a batch whose field {scalars[0]!r} is a scalar: an example, not a "
            "batch; batch the examples (grain: .batch(32)), giving each field a leading batch axis"
        )
    if len(set(rows.values())) > 1:
        sizes = ", ".join(f"{key!r}: {shape[0]}" for key, shape in rows.items())
        raise DataError(
            f"{name} yielded a batch whose fields have different row counts ({sizes}); give "
            "every field the same leading batch axis, one row per example"
        )


def check_not_one_batch(name: str, value: Any) -> None:
    """A dict of arrays or one array passed where batches go: iterating it gives its keys or its
    rows, which would fail deep in the device transfer."""
    if isinstance(value, Mapping | np.ndarray):
        parts = "keys" if isinstance(value, Mapping) else "rows"
        raise ConfigError(
            f"{name} is one {type(value).__name__}, and iterating it gives its {parts}, not "
            "batches; pass an iterable of batch dicts, e.g. grain.MapDataset.source(examples)"
            ".batch(32) over a list of {'x': ..., 'y': ...} examples"
        )


def checked_eval(make_eval: Callable[[], Iterable[Any]]) -> Callable[[], BatchDicts]:
    """`make_eval`, whose every pass checks its batches as `BatchDicts` does."""
    return lambda: BatchDicts(make_eval(), "eval_data")


def _described(value: Any) -> str:
    """A yielded value in an error line: its type, and its shape for an array."""
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__}" + ("" if shape is None else f" of shape {tuple(shape)}")
