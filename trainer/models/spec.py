"""What the trainer asks of a model kind, in one place (torchtitan's ModelSpec, in small): how to
build it and what a token costs to train, then the parts only some kinds have: pipeline stages,
a decoder for generation, a Hugging Face adapter. Callers ask the spec, never the kind's name."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from flax import nnx

from trainer.config import Config, ModelConfig
from trainer.errors import ConfigError

# (model.*, *, vocab_size, rngs, compute_dtype, param_dtype, pipeline, max_docs_per_row) -> Module
ModelFactory = Callable[..., nnx.Module]
# What the trainer passes an imported factory (`model.kind: my_pkg.models:build`) after model.*
FACTORY_KEYWORDS = ("vocab_size", "rngs", "compute_dtype", "param_dtype")
PyTree = Any


class Decoder(NamedTuple):
    """Incremental decoding over a cache: `empty_cache(model, batch, length)`, then
    `decode(model, tokens_BxT, start, cache) -> (float32 logits_BxTxV, cache)`."""

    empty_cache: Callable[[nnx.Module, int, int], Any]
    decode: Callable[..., tuple[Any, Any]]


class HfAdapter(NamedTuple):
    """A kind's Hugging Face folder mapping (`trainer/hf/`)."""

    config_json: Callable[[ModelConfig, int, str], dict[str, Any]]  # (model.*, vocab, dtype)
    save_weights: Callable[[PyTree, Path], Any]  # (params, folder)
    load_params: Callable[[str | Path, PyTree], PyTree]  # (folder, restore target) -> params


def dense_flops_per_token(config: Config, num_params: int, vocab_size: int) -> float:
    """6 FLOPs per parameter and token or example (forward + backward): any model's estimate."""
    return 6.0 * num_params


def no_note(config: Config) -> str:
    return ""


@dataclass(frozen=True)
class ModelSpec:
    """A model kind: its factory, and what the trainer may ask of it beyond training."""

    factory: ModelFactory
    flops_per_token: Callable[[Config, int, int], float] = dense_flops_per_token
    pipelined: bool = False  # its factory splits the layer stack into `pipeline`'s stages
    decoder: Decoder | None = None  # generation and `eval.sample_prompts`
    hf: HfAdapter | None = None  # `checkpoint.init_from=hf:PATH`, `export --format hf`
    startup_note: Callable[[Config], str] = no_note  # appended to the run's first line


def imported_spec(kind: str) -> ModelSpec:
    """`package.module:factory` from the user's code: 6N FLOPs, no stages, decoder or adapter.
    Its factory takes `(model.*, *, vocab_size, rngs, compute_dtype, param_dtype)`."""
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
        raise ConfigError(
            f"model.kind={kind!r}: {module_name} has no callable {attribute!r}; name a function "
            "in it, as module:function"
        )
    check_factory_signature(kind, factory)

    def build(config, *, pipeline=None, max_docs_per_row=None, **settings) -> nnx.Module:
        return factory(config, **settings)

    return ModelSpec(factory=build)


def check_factory_signature(kind: str, factory: Callable[..., Any]) -> None:
    """An imported factory must take what the trainer passes; a mismatch otherwise surfaces as
    a TypeError from inside the sharded init."""
    signature = call_signature(factory)  # None: Python cannot tell; call it as documented
    if signature is not None and not binds(signature, None, **dict.fromkeys(FACTORY_KEYWORDS)):
        raise ConfigError(
            f"model.kind={kind!r} takes {signature}; a model factory takes (config, *, "
            f"{', '.join(FACTORY_KEYWORDS)}) (add **kwargs for the ones it does not use)"
        )


def call_signature(factory: Callable[..., Any]) -> inspect.Signature | None:
    """What calling `factory` takes; a class's `__init__` without `self` (an nnx.Module's
    metaclass shows only `*args, **kwargs`). None where Python cannot tell."""
    try:
        if not isinstance(factory, type):
            return inspect.signature(factory)
        signature = inspect.signature(factory.__init__)
    except (TypeError, ValueError):
        return None
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def binds(signature: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    """Whether a call with these arguments fits `signature`."""
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def caller_spec(build: Callable[[nnx.Rngs], nnx.Module]) -> ModelSpec:
    """A model passed to `trainer.run` (`build`: rngs -> Module), known only by its builder."""
    return ModelSpec(factory=lambda config, *, rngs, **settings: build(rngs))
