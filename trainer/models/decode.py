"""Incremental decoding of the built-in transformer with a key/value cache: the same layers and
weights as its training forward pass, but each call feeds only new tokens and attends to the
keys and values of every earlier one. The cache is explicit arrays passed in and out, so one
jitted function holds the whole generation loop."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.models.attention import attention_dtype, bf16_dots_refused, device_facts
from trainer.models.kernels import dropout_attention
from trainer.models.layers import Attention, PackedLayout
from trainer.models.transformer import Transformer


class KVCache(NamedTuple):
    """Keys and values of every layer at every position written so far (the rest are zeros)."""

    k: jax.Array  # [layers, B, S, kv heads, head dim]
    v: jax.Array

    @classmethod
    def empty(cls, model: Transformer, batch: int, length: int) -> KVCache:
        spec = model.spec
        shape = (spec.num_layers, batch, length, spec.num_kv_heads, spec.head_dim)
        zeros = jnp.zeros(shape, spec.compute_dtype)
        return cls(zeros, zeros)


def _cached_attention(
    attn: Attention, x_BxTxD, layout: PackedLayout, start, mask, k_cache, v_cache
):
    """Attention of T new tokens at positions start.. over the cache, which they are written to."""
    B, T, _ = x_BxTxD.shape
    q_BxTxHxK, k_BxTxGxK, v_BxTxGxK = attn.rotated_qkv(x_BxTxD, layout)
    at = (0, start, 0, 0)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k_BxTxGxK.astype(k_cache.dtype), at)
    v_cache = jax.lax.dynamic_update_slice(v_cache, v_BxTxGxK.astype(v_cache.dtype), at)
    dtype = attention_dtype(attn.compute_dtype)
    q, k, v = (x.astype(dtype) for x in (q_BxTxHxK, k_cache, v_cache))
    if bf16_dots_refused(*device_facts(), dtype):  # as training's `xla_written` kernel
        out_BxTxHxK = dropout_attention(q, k, v, mask, 0.0, None)
    else:
        out_BxTxHxK = jax.nn.dot_product_attention(q, k, v, mask=mask)
    out_BxTxHxK = out_BxTxHxK.astype(q_BxTxHxK.dtype)
    return attn.out(out_BxTxHxK.reshape(B, T, attn.num_heads * attn.head_dim)), k_cache, v_cache


def decode(
    model: Transformer, tokens_BxT: jax.Array, start: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """Float32 logits `[B, T, V]` of `tokens_BxT` at positions `start..start+T-1`, given the
    cache of every earlier position; returns the cache with these tokens' keys and values."""
    spec = model.spec
    B, T = tokens_BxT.shape
    length = cache.k.shape[2]
    positions_T = start + jnp.arange(T)
    layout = PackedLayout.of(
        None,
        jnp.broadcast_to(positions_T, (B, T)),
        spec.head_dim,
        spec.rope_theta,
        spec.rope_scaling,
    )
    # causal over the cache: a query sees the keys at its own position and before
    mask_1x1xTxS = (jnp.arange(length)[None, :] <= positions_T[:, None])[None, None]
    graphdef, stacked = model.stacked_layers()

    def body(x_BxTxD, layer):
        state, k_cache, v_cache = layer
        block = nnx.merge(graphdef, state)
        h, k_cache, v_cache = _cached_attention(
            block.attn, block.attn_norm(x_BxTxD), layout, start, mask_1x1xTxS, k_cache, v_cache
        )
        x_BxTxD = x_BxTxD + h
        x_BxTxD = x_BxTxD + block.mlp(block.mlp_norm(x_BxTxD))
        return x_BxTxD, (k_cache, v_cache)

    x_BxTxD, (k, v) = jax.lax.scan(body, model.embed(tokens_BxT), (stacked, cache.k, cache.v))
    return model.logits(x_BxTxD), KVCache(k, v)
