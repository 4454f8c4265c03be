"""One step's items read back onto this run's model, failed on every process when one fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from input_pipeline import checkpointing as data_checkpointing
from trainer.checkpoint.failures import DamageError, damage_in, interrupt_in, mentions, read_problem
from trainer.checkpoint.items import (
    META_FILE,
    RESUME_ANOTHER_MODEL,
    TREE_FILE,
    abstract_loss_scale,
    changed_keys,
    param_shapes,
    saved_a_loss_scale,
    train_part,
    tree_file_problem,
)
from trainer.config import Config, saved_config
from trainer.errors import ConfigError, TrainingError
from trainer.parallel.agreement import gather_rows
from trainer.parallel.state import TrainState

# A restore's outcome on one process, agreed across processes as the largest of them.
RESTORED, DAMAGED, STOPS = 0, 1, 2


class FailedElsewhereError(Exception):
    """An item read that did not fail here, on a process whose peer's read of it did: every
    process leaves the restore at the same read, so their next collective is the same one."""


class StepReader:
    """The reads of one step's items from `manager`'s folder `directory`; the `Checkpointer`
    (a `StepReader`) decides which step, and opens the manager."""

    directory: Path
    manager: ocp.CheckpointManager

    def _read_items(self, step: int, **items: ocp.args.CheckpointArgs) -> Any:
        """`manager.restore` of `items`, failed on every process when it fails on one (with
        `FailedElsewhereError` where it did not): a process that went on to the next read
        would wait in its barrier for one that never comes, or meet its all-gather there."""
        restored, failure = None, None
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:
            failure = self._shown_damage(step, items, err)
        if worst_on_any_process(RESTORED if failure is None else STOPS) != RESTORED:
            raise failure or FailedElsewhereError(f"step {step} failed on another process")
        return restored

    def _shown_damage(
        self, step: int, items: dict[str, ocp.args.CheckpointArgs], failure: Exception
    ) -> Exception:
        """`failure` of a read of `items`; as a `DamageError` when it is no evidence of damage
        itself (a JAX tree error, a KeyError: what a bug raises too) but a pytree item's tree
        file is missing or does not hold a tree (JSON that does not parse is evidence itself)."""
        if damage_in(failure) or interrupt_in(failure) or read_problem(failure):
            return failure
        for name, args in items.items():
            if not isinstance(args, ocp.args.StandardRestore):
                continue
            if (problem := tree_file_problem(self.directory / str(step) / name)) is not None:
                damage = DamageError(problem)
                damage.__cause__ = failure
                return damage
        return failure

    def read_meta(self, step: int) -> dict[str, Any]:
        """The run's metadata saved with `step` (config, dataset fingerprint, shapes)."""
        restored = self._read_items(step, meta=ocp.args.JsonRestore())
        if not isinstance(restored.meta, dict):  # every save writes a mapping
            raise DamageError(f"its {META_FILE} is not a JSON object")
        return restored.meta

    def run_config(self, step: int) -> Config:
        """The config the run saved with `step`, its vocabulary filled in: the model to rebuild
        (export, generate)."""
        meta = self.read_meta(step)
        config = saved_config(meta["config"], self.directory / str(step) / META_FILE)
        return config.derive({"model.vocab_size": meta["vocab_size"]})

    def restore(
        self, step: int, target: TrainState, run_config: dict[str, Any] | None = None
    ) -> tuple[TrainState, dict | None, dict[str, Any]]:
        """`(state, data position, metadata)` of `step`: the metadata is the one this restore
        read, for the caller to use rather than read again after the restore.

        Restore onto `target`'s shapes and shardings (so a new mesh reshards on load), memory
        kinds included: offloaded parts (`trainer.parallel.offload`) are read straight into
        pinned host memory, never through the device memory they were offloaded to spare (orbax
        0.12 passes the memory kind through: no memory-kind mismatch, tests/test_offload.py).

        The loss scale is read as saved, whatever this run's precision: the state's
        `loss_scale` is the checkpoint's (None when it computed in bf16/fp32), for the caller
        to keep or replace. Any other change of the state's layout (`run_config`, the run's
        config, against the saved one) is one line, and the checkpoint is left in place."""
        meta = self.read_meta(step)
        self._check_shapes(step, target.params, RESUME_ANOTHER_MODEL, meta)
        part = train_part(target)
        part.pop("loss_scale", None)
        if saved_a_loss_scale(meta, target):
            part["loss_scale"] = abstract_loss_scale(target.step.sharding)
        try:
            restored = self._read_items(
                step,
                params=ocp.args.StandardRestore(target.params),
                train=ocp.args.StandardRestore(part),
            )
        except ValueError as err:
            if not mentions(str(err), ("tree structures do not match",)):
                raise
            saved = meta.get("config", {})
            raise ConfigError(self._layout_changed(step, saved, run_config)) from None
        train = restored.train
        state = TrainState(
            step=train["step"],
            params=restored.params,
            model_state=train["model_state"],
            opt_state=train["opt_state"],
            loss_scale=train.get("loss_scale"),
        )
        data_state = data_checkpointing.restore_position(
            self.directory / str(step) / "data", jax.process_index(), jax.process_count()
        )
        return state, data_state, meta

    def restore_params(
        self,
        step: int,
        target_params: Any,
        fix: str = RESUME_ANOTHER_MODEL,
        meta: dict[str, Any] | None = None,
    ) -> Any:
        """Parameters only (fine-tuning from another run, export); `fix` ends the line that
        refuses another model's checkpoint; `meta`: the step's metadata, if read already."""
        self._check_shapes(step, target_params, fix, meta)
        restored = self._read_items(step, params=ocp.args.StandardRestore(target_params))
        return restored.params

    def restore_model_state(
        self, step: int, target_model_state: Any, meta: dict[str, Any] | None = None
    ) -> Any | None:
        """The floating-point non-parameter state of `step` (BatchNorm statistics, a module's
        buffers) that `target_model_state` shares with it, path and shape alike, as a subtree of
        it: what `checkpoint.init_from` carries beside the parameters. Random streams and counters
        are left out (a new run draws its own); None where nothing is shared, or the checkpoint
        predates `model_state_shapes` in its metadata (`meta`, if read already)."""
        saved = (meta or self.read_meta(step)).get("model_state_shapes")
        if not isinstance(saved, dict):
            return None
        flat = jax.tree_util.tree_flatten_with_path(target_model_state)[0]
        shared = {
            jax.tree_util.keystr(path)
            for path, leaf in flat
            if jax.dtypes.issubdtype(leaf.dtype, np.floating)
            and saved.get(jax.tree_util.keystr(path)) == list(leaf.shape)
        }
        subset = subtree(target_model_state, shared)
        if subset is None:
            return None
        item = {"model_state": subset}
        restored = self._read_items(
            step,
            train=ocp.args.PyTreeRestore(
                item,
                restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                partial_restore=True,
            ),
        )
        return restored.train["model_state"]

    def _layout_changed(
        self, step: int, saved: dict[str, Any], run_config: dict[str, Any] | None
    ) -> str:
        """The line for a checkpoint whose optimizer or model state is laid out otherwise than
        this run's (`optim.clip_norm` null against a number, `model.dropout` 0 against more)."""
        where = self.directory / str(step)
        changed = changed_keys(saved, run_config or {}, ("model", "optim"))
        keys = "; ".join(
            f"{k}: saved {json.dumps(a)}, now {json.dumps(b)}" for k, a, b in changed[:4]
        )
        which = f" ({keys})" if keys else ""
        new_run = (
            f"start a new run.workdir with checkpoint.init_from={self.directory.parent} to keep "
            "its weights"
        )
        if run_config is not None and isinstance(saved, dict) and not changed:
            return (
                f"checkpoint {where} holds optimizer or model state laid out otherwise than this "
                "run's, though it was saved with this run's model.* and optim.* settings: its "
                f"params/{TREE_FILE} or train/{TREE_FILE} is damaged, or the model's or "
                f"optimizer's code changed since; rename {step} to {step}.damaged to resume from "
                f"the checkpoint before it, or {new_run}"
            )
        return (
            f"checkpoint {where} holds optimizer or model state laid out otherwise than this "
            f"run's{which}; resume with the settings it was saved with, or {new_run}"
        )

    def _check_shapes(
        self, step: int, target_params: Any, fix: str, meta: dict[str, Any] | None = None
    ) -> None:
        saved = (meta or self.read_meta(step)).get("param_shapes")
        if not isinstance(saved, dict):  # every save writes them: the metadata is damaged
            raise DamageError("its meta/ item records no parameter shapes")
        wanted = param_shapes(target_params)
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
            + f"); {fix}"
        )


def worst_on_any_process(outcome: int) -> int:
    """The largest of every process's `outcome` (RESTORED < DAMAGED < STOPS), so all pick the
    same checkpoint, and all stop when one must."""
    everyone, _ = gather_rows(np.array(outcome, np.int32))
    return int(np.max(everyone))


def subtree(tree: Any, keep: set[str], path: tuple = ()) -> Any:
    """The nested dicts of `tree` down to the leaves whose `keystr` path is in `keep`; None
    where none is."""
    if isinstance(tree, dict):
        kept = {}
        for key, value in tree.items():
            sub = subtree(value, keep, (*path, jax.tree_util.DictKey(key)))
            if sub is not None:
                kept[key] = sub
        return kept or None
    return tree if jax.tree_util.keystr(path) in keep else None
