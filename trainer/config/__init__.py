"""The run config: the typed schema with its defaults (`schema`), read from a YAML file and
`section.key=value` overrides (`reading`); a user mistake is one `ConfigError` line naming the
key and the fix (`validation`)."""

from trainer.config.reading import config_from_dict, load_config, saved_config
from trainer.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    LogConfig,
    MeshConfig,
    MixtureSource,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    PrecisionConfig,
    RunConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "LogConfig",
    "MeshConfig",
    "MixtureSource",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "PrecisionConfig",
    "RunConfig",
    "config_from_dict",
    "load_config",
    "saved_config",
]
