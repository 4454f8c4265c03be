"""Model registry: `model.kind` is a registered name (`transformer`) or an import path
(`my_pkg.models:build`), so a user's model never needs a fork of the trainer. Each kind is a
`ModelSpec` (`trainer/models/spec.py`); the builders here turn a config into `rngs -> Module`.

An imported factory has the signature `build(config: ModelConfig, *, vocab_size: int, rngs:
nnx.Rngs, compute_dtype, param_dtype) -> nnx.Module`; `config.args` carries any extra keys.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from trainer.config import Config, ModelConfig
from trainer.errors import ConfigError
from trainer.hf.config import hf_config
from trainer.hf.weights import load_hf_params, save_hf_weights
from trainer.models.attention import run_attention_note
from trainer.models.decode import KVCache, decode
from trainer.models.spec import (
    Decoder,
    HfAdapter,
    ModelSpec,
    binds,
    call_signature,
    caller_spec,
    imported_spec,
)
from trainer.models.transformer import build_transformer, transformer_flops_per_token
from trainer.parallel import sharding
from trainer.parallel.pipeline import PipelineSpec
from trainer.parallel.state import ModelSkeleton, abstract_model, with_shardings

Builder = Callable[..., nnx.Module]  # rngs -> Module

TRANSFORMER = ModelSpec(
    factory=build_transformer,
    flops_per_token=transformer_flops_per_token,
    pipelined=True,
    decoder=Decoder(KVCache.empty, decode),
    hf=HfAdapter(hf_config, save_hf_weights, load_hf_params),
    startup_note=run_attention_note,
)
MODELS: Mapping[str, ModelSpec] = MappingProxyType({"transformer": TRANSFORMER})


def model_spec(kind: str) -> ModelSpec:
    """A registered kind's spec, or the generic one of an import path."""
    if kind in MODELS:
        return MODELS[kind]
    if ":" not in kind:
        raise ConfigError(
            f"model.kind={kind!r} is not a built-in model ({', '.join(MODELS)}); "
            "use one of those or an import path like my_pkg.models:build"
        )
    return imported_spec(kind)


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
    which only `trainer.parallel.sharding` can map to mesh axes (the trainer places them itself)."""
    spec = model_spec(config.kind)
    if pipeline is not None and not spec.pipelined:
        raise ConfigError(
            f"mesh.stage={pipeline.stages} splits the built-in transformer's layer stack into "
            f"pipeline stages; model.kind={config.kind} has none: use mesh.stage=1 (and "
            "mesh.fsdp / mesh.tensor to split the model)"
        )
    with nnx.use_eager_sharding(False):
        return spec.factory(
            config,
            vocab_size=vocab_size,
            rngs=rngs,
            compute_dtype=jnp.dtype(compute_dtype),
            param_dtype=jnp.dtype(param_dtype),
            pipeline=pipeline,
            max_docs_per_row=max_docs_per_row,
        )


def pipeline_spec(config: Config) -> PipelineSpec | None:
    """The pipeline `mesh.stage` and `pipeline.*` ask for; None without stages."""
    if config.mesh.stage == 1:
        return None
    return PipelineSpec(config.mesh.stage, config.pipeline_microbatches)


def builder_for_vocab(config: Config, vocab_size: int | None = None) -> Builder:
    """`rngs -> Module` for the configured model at `vocab_size` (default `model.vocab_size`)."""
    return functools.partial(
        build_model,
        config.model,
        vocab_size=vocab_size or config.model.vocab_size,
        compute_dtype=config.precision.compute,
        param_dtype=config.precision.params,
        pipeline=pipeline_spec(config),
        max_docs_per_row=config.data.resolved_max_docs_per_row,
    )


def run_model(config: Config, model: Any, dataset_vocab: int) -> tuple[ModelSpec, Builder]:
    """The spec and builder of what a run trains: a caller's `model` (an `nnx.Module`, whose
    current values become the initial state, or a factory `rngs -> Module`), else the configured
    kind with its vocabulary checked against the dataset's."""
    if isinstance(model, nnx.Module):
        graphdef, values = nnx.split(model)
        build = lambda rngs: nnx.merge(graphdef, values)  # noqa: E731
        return caller_spec(build), build
    if callable(model):
        build = caller_builder(model)
        return caller_spec(build), build
    if model is not None:
        raise ConfigError(f"model={model!r} is neither an nnx.Module nor a factory rngs -> Module")
    vocab_size = config.model.vocab_size or dataset_vocab
    if not vocab_size:
        raise ConfigError("model.vocab_size is unset and the data has no vocabulary; set it")
    if vocab_size < dataset_vocab:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the dataset's vocabulary "
            f"({dataset_vocab}); raise model.vocab_size or leave it unset"
        )
    return model_spec(config.model.kind), builder_for_vocab(config, vocab_size)


def caller_builder(factory: Callable[..., nnx.Module]) -> Builder:
    """`rngs -> Module` from a caller's factory, which takes `rngs` by position or, as flax
    modules often do (`__init__(self, *, rngs)`), by keyword."""
    signature = call_signature(factory)
    if signature is None or binds(signature, None):
        return lambda rngs: factory(rngs)
    if binds(signature, rngs=None):
        return lambda rngs: factory(rngs=rngs)
    name = getattr(factory, "__qualname__", type(factory).__name__)
    raise ConfigError(
        f"model={name} takes {signature}, not rngs alone; pass a factory rngs -> nnx.Module "
        "(e.g. model=lambda rngs: MyModel(..., rngs=rngs)) or a built module"
    )


def abstract_params(config: Config, mesh: Mesh) -> tuple[ModelSkeleton, Any]:
    """The configured model's skeleton (it merges parameters into a module) and its parameters'
    shapes, dtypes and shardings on `mesh`: a restore target, with no weight allocated."""
    rules = sharding.resolve_rules(config.mesh.rules)
    with jax.set_mesh(mesh):
        skeleton, shapes, _ = abstract_model(builder_for_vocab(config), mesh, rules)
    return skeleton, with_shardings(shapes, skeleton.param_shardings)
