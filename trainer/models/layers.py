"""Building blocks of the built-in transformer, and the spec (shape and numerics) they are built
from; each names its parameter axes logically."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.config import ModelConfig
from trainer.models.attention import attention_dtype, check_requested, device_facts
from trainer.models.kernels import DocumentSpans, attend, document_spans, rows_whole
from trainer.models.matmul import linear_dot_general
from trainer.models.rope import RopeScaling, freeze_scaling, scale_frequencies
from trainer.parallel.pipeline import PipelineSpec


@dataclass(frozen=True)
class TransformerSpec:
    """Shape and numerics of the built-in model (filled from `ModelConfig` by its factory)."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    d_model: int
    d_ff: int
    rope_theta: float = 10000.0
    dropout: float = 0.0
    tie_embeddings: bool = False
    remat: str = "none"
    scan_layers: bool = True
    attention: str = "auto"
    compute_dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32
    norm_eps: float = 1e-6
    head_dim: int | None = None  # None: d_model // num_heads (filled in by __post_init__)
    rope_scaling: RopeScaling | None = None
    pipeline: PipelineSpec | None = None  # layers split into stages over the `stage` mesh axis
    # the most documents a packed row holds (`data.max_docs_per_row`, kept by the packers);
    # None: unknown, so no kernel that needs the bound (cuDNN packed documents) is chosen
    max_docs_per_row: int | None = None

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)

    @property
    def dot_general(self):
        """The matmul of every dense layer, picked for this backend (`models/matmul.py`)."""
        return linear_dot_general(device_facts()[0])

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        vocab_size: int,
        compute_dtype,
        param_dtype,
        pipeline: PipelineSpec | None = None,
        max_docs_per_row: int | None = None,
    ) -> TransformerSpec:
        """The shape and numerics `model.*` describes (custom blocks reuse it too)."""
        same_name = {f.name for f in fields(cls)} & set(ModelConfig.model_fields)
        as_configured = {name: getattr(config, name) for name in same_name}
        return cls(
            **dict(
                as_configured,
                vocab_size=vocab_size,  # the dataset's where model.vocab_size is unset
                num_kv_heads=config.num_kv_heads or config.num_heads,
                rope_scaling=freeze_scaling(config.rope_scaling),
                compute_dtype=compute_dtype,
                param_dtype=param_dtype,
                pipeline=pipeline,
                max_docs_per_row=max_docs_per_row,
            )
        )


def partitioned(init, logical_axes: tuple[str, ...]):
    """Attach logical axis names to an initializer (mapped to mesh axes by
    `trainer.parallel.sharding`)."""
    return nnx.with_partitioning(init, logical_axes)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 (the mean of squares underflows in bf16), cast back."""

    def __init__(self, dim: int, param_dtype, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class PackedLayout(NamedTuple):
    """What every attention layer derives from a packed batch's `segment_ids` and `positions`,
    built once per forward pass: inside the layer scan XLA would recompute the mask and the
    rotary angles at every layer, forward and backward. Only what the chosen kernel reads is
    built (`models/kernels.py`)."""

    # [B, 1, L, L]: causal, and never across documents of a packed row (xla, xla_dropout,
    # xla_written, cudnn_mask); None for rows of one document each: causal without a mask
    mask: jax.Array | None
    sin: jax.Array  # [B, L, 1, K/2]: rotary angles at each token's in-document position
    cos: jax.Array
    segment_ids: jax.Array | None = None  # [B, L] (pallas)
    spans: DocumentSpans | None = None  # each document's length and start (cudnn_packed)

    @classmethod
    def of(
        cls,
        segment_ids_BxL: jax.Array | None,
        positions_BxL: jax.Array,
        head_dim: int,
        theta: float,
        rope_scaling: RopeScaling | None = None,
        kernel: str = "xla",
        max_segments: int = 0,
    ) -> PackedLayout:
        half = head_dim // 2
        freqs_F = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
        freqs_F = scale_frequencies(freqs_F, rope_scaling)
        angles_BxLx1xF = (positions_BxL[..., None].astype(jnp.float32) * freqs_F)[:, :, None]
        mask = segment_ids = spans = None
        if segment_ids_BxL is None:
            pass
        elif kernel == "pallas":
            segment_ids = segment_ids_BxL.astype(jnp.int32)
        elif kernel == "cudnn_packed":
            spans = DocumentSpans(*map(rows_whole, document_spans(segment_ids_BxL, max_segments)))
        else:
            mask = packed_causal_mask(segment_ids_BxL)
        return cls(mask, jnp.sin(angles_BxLx1xF), jnp.cos(angles_BxLx1xF), segment_ids, spans)


def rotary(x_BxLxHxD: jax.Array, layout: PackedLayout) -> jax.Array:
    """Rotary position embedding (rotate-half form) at each token's in-document position."""
    sin, cos = layout.sin, layout.cos
    x1, x2 = jnp.split(x_BxLxHxD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxD.dtype)


def packed_causal_mask(segment_ids_BxL: jax.Array) -> jax.Array:
    """Causal mask that also stops attention at document boundaries inside a packed row."""
    length = segment_ids_BxL.shape[1]
    causal_LxL = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    same_doc_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    return (causal_LxL[None] & same_doc_BxLxL)[:, None]  # [B, 1, L, L], broadcast over heads


def dense(d_in: int, d_out: int, axes: tuple[str, str], spec: TransformerSpec, rngs: nnx.Rngs):
    """A bias-free `nnx.Linear` in the spec's dtypes and matmul, its kernel's axes named `axes`."""
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        dtype=spec.compute_dtype,
        param_dtype=spec.param_dtype,
        kernel_init=partitioned(nnx.initializers.lecun_normal(), axes),
        dot_general=spec.dot_general,
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Grouped-query self-attention: `num_kv_heads` key/value heads shared by groups of queries."""

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim, self.compute_dtype = spec.head_dim, spec.compute_dtype
        self.dropout_rate = spec.dropout
        # a forced kernel that cannot run here fails at build, not at the first step's compile
        check_requested(spec.attention, spec.compute_dtype, spec.head_dim)
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.q = dense(spec.d_model, q_dim, ("embed", "heads"), spec, rngs)
        self.k = dense(spec.d_model, kv_dim, ("embed", "kv"), spec, rngs)
        self.v = dense(spec.d_model, kv_dim, ("embed", "kv"), spec, rngs)
        self.out = dense(q_dim, spec.d_model, ("heads", "embed"), spec, rngs)

    def rotated_qkv(self, x_BxLxD, layout: PackedLayout):
        """Queries, keys and values split into heads, queries and keys rotated to each token's
        position: the forward pass and the cached decoder (`models/decode.py`) share them."""
        B, L, _ = x_BxLxD.shape
        q_BxLxHxK = self.q(x_BxLxD).reshape(B, L, self.num_heads, self.head_dim)
        k_BxLxGxK = self.k(x_BxLxD).reshape(B, L, self.num_kv_heads, self.head_dim)
        v_BxLxGxK = self.v(x_BxLxD).reshape(B, L, self.num_kv_heads, self.head_dim)
        return rotary(q_BxLxHxK, layout), rotary(k_BxLxGxK, layout), v_BxLxGxK

    def __call__(self, x_BxLxD, layout: PackedLayout, kernel: str = "xla", dropout_key=None):
        """`kernel`: chosen once per forward pass by the model (`models/attention.py`);
        `dropout_key`: drops attention probabilities (`xla_dropout` only)."""
        B, L, _ = x_BxLxD.shape
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = self.rotated_qkv(x_BxLxD, layout)
        dtype = attention_dtype(self.compute_dtype)
        out_BxLxHxK = attend(
            kernel,
            q_BxLxHxK.astype(dtype),
            k_BxLxGxK.astype(dtype),
            v_BxLxGxK.astype(dtype),
            layout,
            self.dropout_rate,
            dropout_key,
        ).astype(q_BxLxHxK.dtype)
        return self.out(out_BxLxHxK.reshape(B, L, self.num_heads * self.head_dim))


class SwiGLU(nnx.Module):
    """MLP with a SiLU-gated linear unit: column-parallel gate/up, row-parallel down."""

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.gate = dense(spec.d_model, spec.d_ff, ("embed", "mlp"), spec, rngs)
        self.up = dense(spec.d_model, spec.d_ff, ("embed", "mlp"), spec, rngs)
        self.down = dense(spec.d_ff, spec.d_model, ("mlp", "embed"), spec, rngs)

    def __call__(self, x_BxLxD):
        return self.down(nnx.silu(self.gate(x_BxLxD)) * self.up(x_BxLxD))
