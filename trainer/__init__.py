"""A JAX/Flax NNX trainer where the accelerator never waits.

Public API: `load_config`, `Config`, `run`, `RunResult`, and the error types a caller may catch.
"""

from trainer.config import Config, load_config
from trainer.errors import ConfigError, TrainingError


def run(config: Config):
    """Train `config` (see `trainer.train.run`); imported lazily to keep `import trainer` light."""
    from trainer.train import run as _run

    return _run(config)


__all__ = ["Config", "ConfigError", "TrainingError", "load_config", "run"]
