"""A step's data position in an Orbax checkpoint item: one JSON file per process, named here.

Restoring on the process count that saved reads this process's own file; on another count,
every process's per-stream positions are merged (`input_pipeline.streams`) and each process
picks the streams it now owns. `resume_position` puts it back, or refuses in one line a
position that this run's data settings would read otherwise than the run that saved it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from input_pipeline.errors import DataError
from input_pipeline.positions import (
    NEW_RUN,
    DamagedPositionError,
    PositionMismatchError,
    check_position,
    check_stream_state,
    check_undamaged,
    is_stream_state,
)
from input_pipeline.streams import StreamBatches


def position_file(process_index: int | str, process_count: int | str) -> str:
    """The file of one process's position (the names Grain's handler used: old runs resume)."""
    return f"process_{process_index}-of-{process_count}.json"


def handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Orbax's JSON handler for the checkpoint's `data` item, writing on every process (not only
    the primary one) to this process's own file."""
    handler = ocp.JsonCheckpointHandler(
        filename=position_file(jax.process_index(), jax.process_count()),
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None),
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("data", ocp.args.JsonSave, handler)
    registry.add("data", ocp.args.JsonRestore, handler)
    return registry


def save_args(state: Any) -> ocp.args.CheckpointArgs:
    """Orbax args that save this process's data position (JSON-able, or None) as the item."""
    return ocp.args.JsonSave(state)


def restore_position(folder: Path, process_index: int, process_count: int) -> Any:
    """This process's data position from the item folder `save_args` wrote."""
    own = folder / position_file(process_index, process_count)
    if own.exists():
        return json.loads(own.read_text())
    saved = sorted(folder.glob(position_file("*", "*")))
    if not saved:  # a damaged step folder, not the user's mistake
        raise FileNotFoundError(f"its {folder.name}/ item holds no data position")
    states = [json.loads(path.read_text()) for path in saved]
    if not all(is_stream_state(s) for s in states):
        raise DataError(
            f"{folder} holds the data position of {len(saved)} other processes, which cannot be "
            f"split over {process_count}; resume with the process count that wrote it"
        )
    for state in states:
        try:
            check_stream_state(state)
        except DataError as err:
            raise DataError(f"checkpoint {folder.parent}: {err}") from None
    positions = {k: v for state in states for k, v in state["positions"].items()}
    return {"streams": states[0]["streams"], "positions": positions}


def resume_position(
    iterator: Any,
    position: Any,
    step_folder: Path,
    saved_config: dict[str, Any] | None,
    config: dict[str, Any],
) -> None:
    """Put checkpoint `step_folder`'s data `position` back into the run's batch iterator, whose
    own checks refuse a position of another layout before anything moves. Our pipeline
    (`StreamBatches`) also refuses no position at all (null), and a position saved before a
    setting that orders or cuts the data changed (`saved_config`: the checkpoint's config, None
    for none), which would resume elsewhere in silence. Either is one line naming the step
    folder."""
    saved_config = saved_config if isinstance(saved_config, dict) else None
    try:
        if isinstance(iterator, StreamBatches):
            check_position(position, {})  # ours is a mapping; null: a run that saved none
            check_undamaged(position)
            if saved_config is not None:
                check_same_order(saved_config, config)
        if position is not None:  # else none was saved: it starts from its first batch
            iterator.set_state(position)
    except DamagedPositionError as err:
        raise DataError(f"checkpoint {step_folder}: {damaged(step_folder, err)}") from None
    except PositionMismatchError as err:
        changed = changed_data(saved_config, config) if saved_config is not None else ""
        raise DataError(f"checkpoint {step_folder}{changed}: {err}") from None
    except DataError as err:
        raise DataError(f"checkpoint {step_folder}: {err}") from None


def damaged(step_folder: Path, damage: DamagedPositionError) -> str:
    """The line refusing a damaged data position: the file, the value, and the ways out (the
    checkpoint before this one, or a new run from its weights)."""
    step = step_folder.name
    return (
        f"its data position file {position_source(step_folder)} is damaged ({damage}); rename "
        f"{step} to {step}.damaged to resume from the checkpoint before it, or {NEW_RUN}"
    )


def position_source(step_folder: Path) -> str:
    """Where this process's data position was read from, inside the step folder: its own file,
    or (saved on another process count) the data folder whose files were merged."""
    own = Path("data") / position_file(jax.process_index(), jax.process_count())
    return str(own) if (step_folder / own).exists() else "data/"


def check_same_order(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """One-line `DataError` for the first setting whose change moves what a saved position
    points at (`changed_order`)."""
    changed = changed_order(saved, now)
    if not changed:
        return
    key, was, why = changed[0]
    was, value = _shown(was), _shown(_setting(now, key))
    raise DataError(
        f"the checkpoint's data position was saved with {key}={was} and does not carry over to "
        f"{key}={value} ({why}); set {key}={was} to resume this run, or {NEW_RUN}"
    )


_REPACKED = "the rows it points into would be packed otherwise"


def changed_order(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """The settings changed since `saved` (a run's config as a dict) under which a saved
    position would point elsewhere, each with its saved value and why. Carried over: another
    data.seq_len, data.max_docs_per_row or data.global_batch_size under concat packing of one
    dataset (the position is a token of the record stream: rows go on from it), and another
    data.global_batch_size of a mixture too (its rows are the same, in other batches)."""
    was = functools.partial(_setting, saved)
    shuffled = was("data.shuffle") is True or was("data.concat_offset") != "none"
    first_fit = _setting(now, "data.packing") == "first_fit"
    mixture = _setting(now, "data.mixture") is not None
    rules = [
        ("data.shuffle", True, "the records come in another order"),
        ("data.concat_offset", True, "the rows are cut elsewhere"),
        ("run.seed", shuffled, "it seeds the order of the records"),
        ("data.seq_len", first_fit or mixture, _REPACKED),
        ("data.max_docs_per_row", first_fit or mixture, _REPACKED),
        ("data.global_batch_size", first_fit, _REPACKED),
    ]
    return [
        (key, was(key), why)
        for key, applies, why in rules
        if applies and was(key) != _setting(now, key)
    ]


def changed_data(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """ " (saved with data.x=1, now 2; ...)": the data settings that differ from the checkpoint's
    config, which a position that no longer fits likely comes from; "" when none."""
    was, data = saved.get("data", {}), now.get("data", {})
    changed = [key for key in data if key in was and was[key] != data[key]]
    if not changed:
        return ""
    shown = "; ".join(f"data.{k}={_shown(was[k])}, now {_shown(data[k])}" for k in changed)
    return f" (saved with {shown})"


def _setting(config: dict[str, Any], key: str) -> Any:
    """`config`'s value of `section.key` (None when absent)."""
    section, name = key.split(".")
    return config.get(section, {}).get(name)


def _shown(value: Any) -> str:
    """A setting's value as a key=value override writes it (true, 64, none)."""
    return value if isinstance(value, str) else json.dumps(value)
