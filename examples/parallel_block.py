"""A custom language-model block, selected by import path without touching trainer code:

    PYTHONPATH=examples python -m trainer.main --config configs/demo.yaml \\
        model.kind=parallel_block:build

GPT-J / PaLM-style *parallel* block: attention and MLP read the same normalized input and their
outputs are summed, `x + attn(norm(x)) + mlp(norm(x))`. It reuses the built-in layers (which
already name their axes logically), so sharding, bf16 and checkpoints work unchanged. It has no
dropout and no rematerialization, and attends with the XLA kernel: `model.dropout`, `model.remat`
and `model.attention=cudnn` are refused with one line rather than silently ignored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.config import ModelConfig
from trainer.errors import ConfigError
from trainer.models.layers import (
    Attention,
    PackedLayout,
    RMSNorm,
    SwiGLU,
    TransformerSpec,
    partitioned,
)


class ParallelBlock(nnx.Module):
    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.norm = RMSNorm(spec.d_model, spec.param_dtype)
        self.attn = Attention(spec, rngs=rngs)
        self.mlp = SwiGLU(spec, rngs=rngs)

    def __call__(self, x, layout: PackedLayout):
        h = self.norm(x)
        return x + self.attn(h, layout) + self.mlp(h)


class ParallelLM(nnx.Module):
    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        # Tied: the embedding is also the output layer, so std d_model**-0.5 starts the logits
        # near unit scale and the loss near ln V (std 1 started it ~7x higher at d_model 64).
        std = spec.d_model**-0.5
        init = partitioned(nnx.initializers.normal(std), ("vocab", "embed"))
        self.embed = nnx.Embed(
            spec.vocab_size,
            spec.d_model,
            dtype=spec.compute_dtype,
            param_dtype=spec.param_dtype,
            embedding_init=init,
            rngs=rngs,
        )
        self.blocks = nnx.List([ParallelBlock(spec, rngs=rngs) for _ in range(spec.num_layers)])
        self.norm = RMSNorm(spec.d_model, spec.param_dtype)
        self.head_dim, self.rope_theta = spec.head_dim, spec.rope_theta

    def __call__(self, batch: dict[str, jax.Array]) -> jax.Array:
        x = self.embed(batch["inputs"])
        # The attention mask and rotary angles of the packed rows, once for all layers.
        layout = PackedLayout.of(
            batch["segment_ids"], batch["positions"], self.head_dim, self.rope_theta
        )
        for block in self.blocks:
            x = block(x, layout)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)  # tied output embedding


def refuse_what_it_ignores(config: ModelConfig) -> None:
    """The built-in transformer's settings this block does not implement are one line, since
    `model.dropout=0.2` would otherwise train without dropout and say nothing."""
    settings = [  # key, value, whether the block would ignore it, the value to set instead
        ("model.dropout", config.dropout, config.dropout != 0, "0"),
        ("model.remat", config.remat, config.remat != "none", "none"),
        ("model.attention", config.attention, config.attention == "cudnn", "auto"),
    ]
    for key, value, ignored, fix in settings:
        if ignored:
            raise ConfigError(
                f"{key}={value}: this parallel block (examples/parallel_block.py) does not "
                f"implement it; set {key}={fix}, or add it to the block"
            )


def build(config: ModelConfig, *, vocab_size, rngs, compute_dtype, param_dtype) -> ParallelLM:
    """The factory `model.kind=parallel_block:build` names; shape keys come from `model.*`."""
    refuse_what_it_ignores(config)
    spec = TransformerSpec.from_config(config, vocab_size, compute_dtype, param_dtype)
    return ParallelLM(spec, rngs=rngs)
