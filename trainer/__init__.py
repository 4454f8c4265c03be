"""A JAX/Flax NNX trainer where the accelerator never waits.

Public API:
    config = trainer.load_config("configs/demo.yaml", ["optim.lr=1e-3"])
    result = trainer.run(config)                                  # the configured LM
    result = trainer.run(config, model=..., loss_fn=..., data=..., eval_data=...)

`annotate_axes` names the parameter axes of a model you did not write. `run` shards the model
over the configured mesh, applies the precision policy, accumulates
gradients, checkpoints (data position included) and resumes, logs metrics and evaluates.
"""

from trainer.annotate import annotate_axes
from trainer.config import Config, load_config
from trainer.errors import ConfigError, TrainingError


def run(config: Config, **kwargs):
    """Train `config`; see `trainer.train.run` for `model`, `loss_fn`, `data`, `eval_data`.

    Imported lazily so `import trainer` stays light (no JAX backend start-up)."""
    from trainer.train import run as _run

    return _run(config, **kwargs)


__all__ = ["Config", "ConfigError", "TrainingError", "annotate_axes", "load_config", "run"]
