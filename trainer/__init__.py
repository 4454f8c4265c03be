"""A JAX/Flax NNX trainer where the accelerator never waits.

Public API:
    config = trainer.load_config("configs/demo.yaml", ["optim.lr=1e-3"])
    result = trainer.run(config)                                  # the configured LM
    result = trainer.run(config, model=..., loss_fn=..., data=..., eval_data=...)

`annotate_axes` names the parameter axes of a model you did not write. `run` (`trainer.train.run`)
is imported on first use, so that reading a config does not load JAX.
"""

from __future__ import annotations

from typing import Any

from trainer.annotate import annotate_axes
from trainer.config import Config, load_config
from trainer.errors import ConfigError, TrainingError


def __getattr__(name: str) -> Any:
    if name == "run":
        from trainer.train import run

        return run
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


__all__ = ["Config", "ConfigError", "TrainingError", "annotate_axes", "load_config", "run"]
