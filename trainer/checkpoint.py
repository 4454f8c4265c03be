"""Orbax checkpoints: the train state, every host's data-iterator position, and run metadata in
one step folder, saved asynchronously so the loop blocks only for the device-to-host copy."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from trainer.config import CheckpointConfig
from trainer.errors import TrainingError
from trainer.state import TrainState

log = logging.getLogger(__name__)


class DataStateSnapshot:
    """The data position that goes with one step, in the shape Grain's Orbax handler expects.

    The device feed runs ahead of the loop, so the live iterator is already past the batch the
    step consumed; saving this snapshot (taken when that batch was read) resumes exactly.
    """

    def __init__(self, state: dict[str, Any] | None = None):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()

    def set_state(self, state: bytes) -> None:
        self.state = json.loads(state)

    def start_prefetch(self) -> None:  # called by Grain's handler after a restore
        pass


def param_shapes(params: Any) -> dict[str, list[int]]:
    """`path -> shape` of every parameter, saved with each checkpoint to explain mismatches."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): list(np.shape(leaf)) for path, leaf in flat}


class Checkpointer:
    """A thin, explicit wrapper over `ocp.CheckpointManager` for this trainer's items."""

    def __init__(self, directory: str | Path, config: CheckpointConfig):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep,
            enable_async_checkpointing=config.async_,
            create=True,
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as err:
            raise TrainingError(
                f"cannot create checkpoint folder {self.directory}: {err.strerror}; "
                "choose a writable run.workdir"
            ) from None

    def latest_step(self) -> int | None:
        """Latest *complete* step: Orbax only lists finalized step folders."""
        return self.manager.latest_step()

    def save(
        self, step: int, state: TrainState, data_state: dict | None, meta: dict[str, Any]
    ) -> float:
        """Start a save; returns the seconds the caller was blocked (device-to-host copy)."""
        jax.block_until_ready(state)  # time the copy, not the step that is still running
        start = time.perf_counter()
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(DataStateSnapshot(data_state)),
                meta=ocp.args.JsonSave(meta),
            ),
        )
        return time.perf_counter() - start

    def read_meta(self, step: int) -> dict[str, Any]:
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return restored.meta

    def restore(self, step: int, target: TrainState) -> tuple[TrainState, dict | None]:
        """Restore onto `target`'s shapes and shardings (so a new mesh reshards on load)."""
        self._check_shapes(step, target)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target),
                data=grain.checkpoint.CheckpointRestore(DataStateSnapshot()),
            ),
        )
        return restored.state, restored.data.state

    def _check_shapes(self, step: int, target: TrainState) -> None:
        saved = self.read_meta(step).get("param_shapes", {})
        wanted = param_shapes(target.params)
        missing = sorted(set(wanted) - set(saved))
        extra = sorted(set(saved) - set(wanted))
        differ = [k for k in sorted(set(saved) & set(wanted)) if saved[k] != wanted[k]]
        if not (missing or extra or differ):
            return
        parts = [f"{k}: saved {saved[k]} vs model {wanted[k]}" for k in differ[:3]]
        parts += [f"{k}: not in checkpoint" for k in missing[:3]]
        parts += [f"{k}: not in model" for k in extra[:3]]
        raise TrainingError(
            f"checkpoint {self.directory / str(step)} is from another model ("
            + "; ".join(parts)
            + "); use a new run.workdir or the model config it was saved with"
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
