"""A modern decoder-only transformer in Flax NNX: RMSNorm, rotary positions, SwiGLU, grouped-query
attention by the kernel `models/attention.py` picks for the device, dtype and batch (cuDNN or
Pallas flash attention over packed documents on NVIDIA GPUs, XLA with the document mask
elsewhere), layers stacked under one `scan` so compile time does not grow with depth.

`model.dropout` drops what nanoGPT drops: the embedding output, the attention probabilities and
both residual branches, in training only (`model.eval()` turns it off; the eval step does).

Every parameter names its axes logically (`embed`, `mlp`, `heads`, `kv`, `vocab`, `layers`,
`norm`); `trainer.parallel.sharding` maps those names to mesh axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from input_pipeline.errors import DataError
from trainer.config import Config, ModelConfig
from trainer.errors import ConfigError
from trainer.models.attention import attention_kernel, facts_here
from trainer.models.kernels import dropout
from trainer.models.layers import (
    Attention,
    PackedLayout,
    RMSNorm,
    SwiGLU,
    TransformerSpec,
    dense,
    partitioned,
)
from trainer.models.matmul import BF16_DOT
from trainer.parallel.offload import offload_dots_policy
from trainer.parallel.pipeline import PipelineSpec, run_pipeline
from trainer.parallel.sharding import STAGE_BATCH_AXES, rows_like_the_batch

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # plain dots, and the bf16 matmuls of `models/matmul.py`, which a dot policy cannot see
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(BF16_DOT),
    ),
    # what save_dots keeps, kept in pinned host memory instead of device memory
    "offload_dots": offload_dots_policy(BF16_DOT),
}


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(spec.d_model, spec.param_dtype, spec.norm_eps)
        self.attn = Attention(spec, rngs=rngs)
        self.mlp_norm = RMSNorm(spec.d_model, spec.param_dtype, spec.norm_eps)
        self.mlp = SwiGLU(spec, rngs=rngs)
        self.dropout_rate = spec.dropout

    def __call__(self, x_BxLxD, layout: PackedLayout, dropout_key=None, kernel: str = "xla"):
        """`dropout_key`: None when nothing is dropped; `kernel`: the attention kernel."""
        keys = [None] * 3 if dropout_key is None else list(jax.random.split(dropout_key, 3))
        h = self.attn(self.attn_norm(x_BxLxD), layout, kernel, keys[2])
        x_BxLxD = x_BxLxD + dropout(h, self.dropout_rate, keys[0])
        h = self.mlp(self.mlp_norm(x_BxLxD))
        x_BxLxD = x_BxLxD + dropout(h, self.dropout_rate, keys[1])
        # inside a pipeline stage (vmapped over `stage`) rows split over (data, fsdp) only
        return rows_like_the_batch(x_BxLxD, STAGE_BATCH_AXES)


def token_inputs(batch: dict[str, jax.Array]) -> jax.Array:
    """`batch["inputs"]`, checked at trace time: a caller's batch without integer token ids
    would otherwise fail inside flax's embedding lookup."""
    if "inputs" not in batch:
        raise DataError(
            f"the built-in transformer reads batch key 'inputs' (token ids [B, L]), and this "
            f"batch has {sorted(batch)}; yield LM batches, or pass your own model= to "
            "trainer.run"
        )
    inputs_BxL = batch["inputs"]
    if not jnp.issubdtype(inputs_BxL.dtype, jnp.integer) or inputs_BxL.ndim != 2:
        raise DataError(
            f"batch['inputs'] is {inputs_BxL.dtype} of shape {tuple(inputs_BxL.shape)}; token "
            "ids must be integers of shape [B, L]: yield them as np.int32"
        )
    return inputs_BxL


class Transformer(nnx.Module):
    """Maps a batch dict (`inputs`, `segment_ids`, `positions`) to float32 logits `[B, L, V]`."""

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.spec = spec
        self.deterministic = False  # True: nothing is dropped (`model.eval()`)
        # Tied: the embedding is also the output layer, whose logits must start near unit scale
        # (loss ~ ln V): std d_model**-0.5 gives the final norm's unit-RMS rows logits of std 1
        # at any width, as the untied head's lecun init does. Untied inputs keep std 1.
        embed_std = spec.d_model**-0.5 if spec.tie_embeddings else 1.0
        self.embed = nnx.Embed(
            spec.vocab_size,
            spec.d_model,
            dtype=spec.compute_dtype,
            param_dtype=spec.param_dtype,
            embedding_init=partitioned(nnx.initializers.normal(embed_std), ("vocab", "embed")),
            rngs=rngs,
        )

        @nnx.split_rngs(splits=spec.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_stack(rngs: nnx.Rngs) -> Block:
            return Block(spec, rngs=rngs)

        self.blocks = make_stack(rngs)
        self.final_norm = RMSNorm(spec.d_model, spec.param_dtype, spec.norm_eps)
        if not spec.tie_embeddings:
            self.lm_head = dense(spec.d_model, spec.vocab_size, ("embed", "vocab"), spec, rngs)
        # Dropout needs fresh randomness each step: keep an RNG stream in the model state.
        self.dropout_rngs = nnx.Rngs(dropout=rngs.params()) if spec.dropout > 0 else None

    def __call__(self, batch: dict[str, jax.Array]) -> jax.Array:
        inputs_BxL = token_inputs(batch)
        segment_ids_BxL = batch.get("segment_ids")  # None: one document per row, no mask
        positions_BxL = batch.get("positions")
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(inputs_BxL.shape[1]), inputs_BxL.shape)
        training = not self.deterministic and self.dropout_rngs is not None
        embed_key, layers_key = (None, None)
        if training:
            embed_key, layers_key = jax.random.split(self.dropout_rngs.dropout())
        facts = facts_here(self.spec, inputs_BxL.shape[1], segment_ids_BxL is not None, training)
        kernel = attention_kernel(self.spec.attention, facts)
        x_BxLxD = self.embed(inputs_BxL)
        x_BxLxD = rows_like_the_batch(dropout(x_BxLxD, self.spec.dropout, embed_key))
        layout = PackedLayout.of(
            segment_ids_BxL,
            positions_BxL,
            self.spec.head_dim,
            self.spec.rope_theta,
            self.spec.rope_scaling,
            kernel=kernel,
            max_segments=(self.spec.max_docs_per_row or 0) + 1,
        )
        x_BxLxD = self._run_blocks(x_BxLxD, layout, kernel, layers_key)
        return rows_like_the_batch(self.logits(x_BxLxD))

    def logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """The last layer's output through the final norm and the output head (the embedding
        when tied), in float32: bf16 loses the small probabilities of the softmax and loss."""
        x_BxLxD = self.final_norm(x_BxLxD)
        head = self.embed.attend if self.spec.tie_embeddings else self.lm_head
        return head(x_BxLxD).astype(jnp.float32)

    def stacked_layers(self) -> tuple[nnx.GraphDef, nnx.State]:
        """The layers' graph and their stacked state (`[layers, ...]`), weight matrices already
        in the compute dtype (`_matrices_in`)."""
        graphdef, stacked = nnx.split(self.blocks)
        return graphdef, _matrices_in(self.spec.compute_dtype, stacked)

    def _run_blocks(self, x_BxLxD, layout: PackedLayout, kernel: str, dropout_key=None):
        """One scan over the stacked layers: the step compiles one block, whatever the depth.
        With `scan_layers=False`, a loop over static slices of the same stacked parameters (same
        checkpoints): no stacked residual buffers to zero and slice per layer, which is faster
        for shallow models on CPU (BENCHMARKS.md, nanoGPT recipe); compile time grows with depth.
        With pipeline stages, each stage runs its contiguous share of the layers that way on one
        microbatch at a time (`trainer/parallel/pipeline.py`)."""
        graphdef, stacked = self.stacked_layers()
        layer_keys = None
        if dropout_key is not None:
            layer_keys = jax.random.split(dropout_key, self.spec.num_layers)

        policy = _REMAT_POLICIES.get(self.spec.remat)

        def run_layers(x, layers, layout: PackedLayout):
            def body(x, layer):
                state, key = layer
                return nnx.merge(graphdef, state)(x, layout, key, kernel), None

            if policy is not None:
                body = jax.checkpoint(body, policy=policy, prevent_cse=False)
            if self.spec.scan_layers:
                return jax.lax.scan(body, x, layers)[0]
            for index in range(jax.tree.leaves(layers)[0].shape[0]):
                x, _ = body(x, jax.tree.map(lambda a, i=index: a[i], layers))
            return x

        if self.spec.pipeline is None:
            return run_layers(x_BxLxD, (stacked, layer_keys), layout)

        def stage(stage_layers, x, layout_rows, microbatch):
            state, keys = stage_layers
            if keys is not None:  # each microbatch its own dropout masks
                keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, microbatch)
            return run_layers(x, (state, keys), layout_rows)

        return run_pipeline(stage, (stacked, layer_keys), x_BxLxD, layout, self.spec.pipeline)


def _matrices_in(compute_dtype, stacked):
    """The stacked weight matrices (`[layers, in, out]`) cast to the compute dtype once, before
    the layer scan: each layer's matmul would cast its slice anyway (same values), but per layer
    and again for the gradient, as ~2 small convert kernels per matrix and layer. Norm scales
    (`[layers, D]`) keep their dtype: RMSNorm reads them in float32."""

    def cast(x):
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return x.astype(compute_dtype) if floating and x.ndim >= 3 else x

    return jax.tree.map(cast, stacked)


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


def transformer_flops_per_token(config: Config, num_params: int, vocab_size: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward) except the embedding
    lookups, which are free, plus 12 * layers * width * context for attention (the PaLM
    appendix formula)."""
    model = config.model
    lookup = 0 if model.tie_embeddings else vocab_size * model.d_model  # tied: also the output
    dense = 6.0 * (num_params - lookup)
    # attention width: the query heads' (d_model, unless model.head_dim sets it apart)
    width = model.num_heads * model.head_dim if model.head_dim else model.d_model
    return dense + 12.0 * model.num_layers * width * config.data.seq_len
