"""A step folder's items: what a save writes, what a restore reads them onto, how they compare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from input_pipeline import checkpointing as data_checkpointing
from trainer.checkpoint.failures import DamageError
from trainer.config import PrecisionConfig
from trainer.errors import first_line
from trainer.loss_scale import LossScale, uses_loss_scale
from trainer.parallel.state import TrainState

RESUME_ANOTHER_MODEL = "use a new run.workdir or the model config it was saved with"
META_FILE = "meta/metadata"  # in a step's folder: the `meta` item, as Orbax's JsonSave writes it
TREE_FILE = "_METADATA"  # in a pytree item's folder (`params`, `train`): its tree, as StandardSave


def save_args(
    state: TrainState, data_state: dict | None, meta: dict[str, Any]
) -> ocp.args.Composite:
    """The items of a save of `state`, this host's data position and the run's metadata."""
    return ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        train=ocp.args.StandardSave(train_part(state)),
        data=data_checkpointing.save_args(data_state),
        meta=ocp.args.JsonSave(meta),
    )


def train_part(state: TrainState) -> dict[str, Any]:
    """Everything but the parameters, saved as its own item so `params` restores alone."""
    part = {"step": state.step, "model_state": state.model_state, "opt_state": state.opt_state}
    if state.loss_scale is not None:  # float16 runs: the scale resumes where it was
        part["loss_scale"] = state.loss_scale
    return part


def saved_a_loss_scale(meta: dict[str, Any], target: TrainState) -> bool:
    """Whether the step's train item holds a loss scale: its run computed in float16 (a
    checkpoint written without the run's config, by a caller of `save`: as `target`)."""
    if "config" not in meta:
        return target.loss_scale is not None
    return uses_loss_scale(_saved_compute(meta["config"]))


def _saved_compute(config: Any) -> str:
    """`precision.compute` of a saved config. One without the section (hand-edited: every version
    saved it) computed in the default, bfloat16 in every version: as `load_config` reads it."""
    precision = config.get("precision", {}) if isinstance(config, dict) else None
    if not isinstance(precision, dict):
        raise DamageError(f"its {META_FILE} holds a config that is not a mapping of sections")
    return precision.get("compute", PrecisionConfig().compute)


def abstract_loss_scale(replicated: jax.sharding.Sharding) -> LossScale:
    """A saved float16 loss scale's restore target, whatever this run's precision."""
    return LossScale(
        scale=jax.ShapeDtypeStruct((), np.float32, sharding=replicated),
        clean_steps=jax.ShapeDtypeStruct((), np.int32, sharding=replicated),
    )


def changed_keys(
    saved: dict[str, Any], now: dict[str, Any], sections: tuple[str, ...]
) -> list[tuple[str, Any, Any]]:
    """`(section.key, saved value, run's value)` for every key of `sections` that differs."""
    return [
        (f"{section}.{key}", value, now[section].get(key))
        for section in sections
        if section in now
        for key, value in saved.get(section, {}).items()
        if value != now[section].get(key)
    ]


def param_shapes(params: Any) -> dict[str, list[int]]:
    """`path -> shape` of every parameter, saved with each checkpoint to explain mismatches."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): list(np.shape(leaf)) for path, leaf in flat}


def state_bytes(state: TrainState) -> int:
    """About what a save of `state` writes (before compression)."""
    return sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(state))


def tree_file_problem(item: Path) -> str | None:
    """What a pytree item's tree file (every save writes one) shows wrong: missing, not
    parsing, or JSON without Orbax's `tree_metadata`; None when it looks whole, or cannot be
    read (the failure it was asked about then stands)."""
    where = f"{item.name}/{TREE_FILE}"
    try:
        tree = json.loads((item / TREE_FILE).read_bytes())
    except FileNotFoundError:
        return f"its {where} is missing"
    except OSError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"its {where} does not parse ({first_line(err, with_type=False)})"
    if not (isinstance(tree, dict) and isinstance(tree.get("tree_metadata"), dict)):
        return f"its {where} holds no tree"
    return None
