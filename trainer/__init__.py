"""A JAX/Flax NNX trainer where the accelerator never waits.

Public API:
    config = trainer.load_config("configs/demo.yaml", ["optim.lr=1e-3"])
    result = trainer.run(config)                                  # the configured LM
    result = trainer.run(config, model=..., loss_fn=..., data=..., eval_data=...)

`annotate_axes` names the parameter axes of a model you did not write. `run` shards the model
over the configured mesh, accumulates gradients, checkpoints (data position included) and
resumes, logs metrics and evaluates. It casts nothing: `precision.*` reaches only `model.kind`
models (as their factory's `compute_dtype`/`param_dtype`); a `model=` you pass trains in the
dtypes it creates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from trainer.annotate import annotate_axes
from trainer.config import Config, load_config
from trainer.errors import ConfigError, TrainingError

if TYPE_CHECKING:
    from flax import nnx

    from trainer.train import RunResult


def run(
    config: Config,
    *,
    model: nnx.Module | Callable[[nnx.Rngs], nnx.Module] | None = None,
    loss_fn: Callable[[nnx.Module, dict], tuple[Any, dict]] | None = None,
    data: Iterable[dict] | None = None,
    eval_data: Iterable[dict] | Callable[[], Iterable[dict]] | None = None,
) -> RunResult:
    """Train `config` to `run.steps`, resuming from its workdir's latest checkpoint.

    model: an `nnx.Module` or a factory `rngs -> nnx.Module` (default: `model.*` of the config).
    loss_fn: `(model, batch) -> (mean loss, aux scalars)`; `aux["weight"]` = items averaged over
        (default: next-token cross-entropy).
    data: a Grain dataset or any iterable of numpy batch dicts, this host's rows (default: the
        prepared dataset of `data.*`); a Grain iterator's position is checkpointed.
    eval_data: re-iterable, or a callable returning a fresh iterable, for held-out loss.
    Returns a `RunResult` (final `state`, `step`, `last_metrics`, `eval_loss`).
    """
    from trainer.step import next_token_loss  # heavy imports only when training
    from trainer.train import run as _run

    return _run(
        config, model=model, loss_fn=loss_fn or next_token_loss, data=data, eval_data=eval_data
    )


__all__ = ["Config", "ConfigError", "TrainingError", "annotate_axes", "load_config", "run"]
