"""A JAX/Flax NNX trainer where the accelerator never waits.

Public API:
    config = trainer.load_config("configs/demo.yaml", ["optim.lr=1e-3"])
    result = trainer.run(config)                                  # the configured LM
    result = trainer.run(config, model=..., loss_fn=..., data=..., eval_data=...)

`annotate_axes` names the parameter axes of a model you did not write. It and `run`
(`trainer.train.run`) are imported on first use, so that reading a config does not load JAX. A
user's mistake raises `ConfigError`, `DataError` or `TrainingError`, each a one-line message
naming the fix.
"""

from __future__ import annotations

from typing import Any

from input_pipeline.errors import DataError
from trainer.config import Config, load_config
from trainer.errors import ConfigError, TrainingError


def __getattr__(name: str) -> Any:
    if name == "run":
        from trainer.train import run

        return run
    if name == "annotate_axes":
        from trainer.annotate import annotate_axes

        return annotate_axes
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "TrainingError",
    "annotate_axes",
    "load_config",
    "run",
]
