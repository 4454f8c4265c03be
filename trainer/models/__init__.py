"""Model registry: `model.kind` is a registered name (`transformer`) or an import path
(`my_pkg.models:build`), so a user's model never needs a fork of the trainer.

A factory has the signature `build(config: ModelConfig, *, vocab_size: int, rngs: nnx.Rngs,
compute_dtype, param_dtype) -> nnx.Module`; `config.args` carries any extra keys it wants.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from trainer.config import ModelConfig
from trainer.errors import ConfigError
from trainer.models.transformer import Transformer, TransformerSpec
from trainer.parallel.pipeline import PipelineSpec

ModelFactory = Callable[..., nnx.Module]


def build_transformer(
    config: ModelConfig,
    *,
    vocab_size: int,
    rngs: nnx.Rngs,
    compute_dtype,
    param_dtype,
    pipeline: PipelineSpec | None = None,
    max_docs_per_row: int | None = None,
) -> Transformer:
    """The built-in decoder-only transformer (its layer stack pipelined when `pipeline` is set;
    `max_docs_per_row`: the bound packed rows keep, which the cuDNN packed kernel needs)."""
    if config.args:
        raise ConfigError(
            f"model.args {sorted(config.args)} are not used by model.kind=transformer; remove them"
        )
    spec = TransformerSpec.from_config(
        config, vocab_size, compute_dtype, param_dtype, pipeline, max_docs_per_row
    )
    return Transformer(spec, rngs=rngs)


BUILTIN_MODELS: dict[str, ModelFactory] = {"transformer": build_transformer}


def resolve_factory(kind: str) -> ModelFactory:
    """A registered name, or `package.module:attribute` imported from the user's code."""
    if kind in BUILTIN_MODELS:
        return BUILTIN_MODELS[kind]
    if ":" not in kind:
        raise ConfigError(
            f"model.kind={kind!r} is not a built-in model ({', '.join(BUILTIN_MODELS)}); "
            "use one of those or an import path like my_pkg.models:build"
        )
    module_name, _, attribute = kind.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"model.kind={kind!r}: cannot import {module_name} ({err}); install the package "
            "or add it to PYTHONPATH"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(f"model.kind={kind!r}: {module_name} has no callable {attribute!r}")
    return factory


def build_model(
    config: ModelConfig,
    *,
    vocab_size: int,
    rngs: nnx.Rngs,
    compute_dtype: Any,
    param_dtype: Any,
    pipeline: PipelineSpec | None = None,
    max_docs_per_row: int | None = None,
) -> nnx.Module:
    """Build the configured model. Eager sharding is off: parameters carry *logical* axis names,
    which only `trainer.parallel.sharding` can map to mesh axes (the trainer places them itself).
    Pipeline stages exist for the built-in transformer only: its stacked layers are what the
    stages split."""
    factory = resolve_factory(config.kind)
    if pipeline is not None and factory is not build_transformer:
        raise ConfigError(
            f"mesh.stage={pipeline.stages} splits the built-in transformer's layer stack into "
            f"pipeline stages; model.kind={config.kind} has none: use mesh.stage=1 (and "
            "mesh.fsdp / mesh.tensor to split the model)"
        )
    extra = {} if pipeline is None else {"pipeline": pipeline}
    if max_docs_per_row is not None and factory is build_transformer:
        extra["max_docs_per_row"] = max_docs_per_row
    with nnx.use_eager_sharding(False):
        return factory(
            config,
            vocab_size=vocab_size,
            rngs=rngs,
            compute_dtype=jnp.dtype(compute_dtype),
            param_dtype=jnp.dtype(param_dtype),
            **extra,
        )
