"""A step's data position in an Orbax checkpoint item: one JSON file per process, named here.

Restoring on the process count that saved reads this process's own file; on another count,
every process's per-stream positions are merged (`input_pipeline.streams`) and each process
picks the streams it now owns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from input_pipeline.errors import DataError
from input_pipeline.streams import is_stream_state


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
    positions = {k: v for state in states for k, v in state["positions"].items()}
    return {"streams": states[0]["streams"], "positions": positions}
