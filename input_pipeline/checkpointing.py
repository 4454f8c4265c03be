"""A step's data position in an Orbax checkpoint item, saved per process by Grain's handler.

Restoring on the process count that saved reads this process's own file; on another count,
every process's per-stream positions are merged (`input_pipeline.streams`) and each process
picks the streams it now owns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grain
import orbax.checkpoint as ocp

from input_pipeline.errors import DataError
from input_pipeline.streams import is_stream_state


class _Snapshot:
    """The position as Grain's handler asks for it: an object with `get_state() -> bytes`.

    The device feed runs ahead of the loop, so the live iterator is already past the batch a
    step consumed; saving the state taken when that batch was read resumes exactly."""

    def __init__(self, state: Any):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()


def save_args(state: Any) -> ocp.args.CheckpointArgs:
    """Orbax args that save this process's data position (JSON-able, or None) as one item."""
    return grain.checkpoint.CheckpointSave(_Snapshot(state))


def restore_position(folder: Path, process_index: int, process_count: int) -> Any:
    """This process's data position from the item folder `save_args` wrote."""
    own = folder / f"process_{process_index}-of-{process_count}.json"
    if own.exists():
        return json.loads(own.read_text())
    saved = sorted(folder.glob("process_*-of-*.json"))
    states = [json.loads(path.read_text()) for path in saved]
    if not states or not all(is_stream_state(s) for s in states):
        raise DataError(
            f"{folder} holds the data position of {len(saved)} other processes, which cannot be "
            f"split over {process_count}; resume with the process count that wrote it"
        )
    positions = {k: v for state in states for k, v in state["positions"].items()}
    return {"streams": states[0]["streams"], "positions": positions}
