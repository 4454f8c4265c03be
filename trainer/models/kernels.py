"""The attention kernels `models/attention.py` chooses between, behind one call (`attend`).

Two of them sit behind APIs jax does not promise to keep, so each is probed once per process,
on the device, against XLA before its first use (`probe`); one that fails is reported in one
line and the next kernel runs instead:
- `cudnn_packed`: cuDNN flash attention over the documents of packed rows, through the private
  `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` with per-row document lengths
  and starts (`document_spans`). jax 0.10.2-0.11.0 scale the key/value starts by the *query* head
  count (fixed by jax PR #39521): the probe runs grouped-query heads and, where that is wrong but
  repeated K/V heads are right, the kernel repeats them.
- `pallas`: `jax.experimental.pallas.ops.gpu.attention.mha` with segment ids (Triton), the same
  mask as XLA's, any number of documents; it wants as many K/V heads as query heads. jax 0.12
  deprecates that module (for the separate `tokamax` package) with a warning at import, the
  kernel itself unchanged: `pallas_gpu_attention` imports it without the warning.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from trainer.errors import first_line
from trainer.parallel.sharding import BATCH_AXES

_CUDNN_PACKED_PARAMS = {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type"}
_PALLAS_PARAMS = {"segment_ids", "sm_scale", "causal", "block_sizes", "interpret"}
_PROBE_TOLERANCE = 3e-2  # bf16 attention of unit-scale inputs: errors ~1e-2; a wrong kernel ~1


_PLANNED_DEVICE: ContextVar[tuple[str, str | None] | None] = ContextVar("planned", default=None)


@contextmanager
def planned_device(platform: str, compute_capability: str | None) -> Iterator[None]:
    """Inside: models are built and traced for this device instead of this process's (an
    ahead-of-time compile for a GPU that is not here: nothing is probed, Pallas compiles for the
    GPU rather than its interpreter)."""
    token = _PLANNED_DEVICE.set((platform, compute_capability))
    try:
        yield
    finally:
        _PLANNED_DEVICE.reset(token)


def planned_device_facts() -> tuple[str, str | None] | None:
    """The (platform, compute capability) `planned_device` traces for, or None."""
    return _PLANNED_DEVICE.get()


def _compiles_for_gpu() -> bool:
    planned = planned_device_facts()
    return (planned[0] if planned else jax.default_backend()) == "gpu"


class DocumentSpans(NamedTuple):
    """Where each document of a packed row lies, as the cuDNN packed layout takes it: `M` slots
    per row, a document being a run of equal segment ids (a padding run is one of its own, so
    every token lies in some document: cuDNN never writes the output of a token outside all)."""

    lengths: jax.Array  # int32 [B, M] tokens per document, -1 past the row's last one
    starts: jax.Array  # int32 [B, M+1] first token of each document, -1 past the last
    overflow: jax.Array  # bool [B]: the row holds more than M documents (its output is NaN)


def document_spans(segment_ids_BxL: jax.Array, max_segments: int) -> DocumentSpans:
    """Per-row document lengths and starts derived in-graph from `segment_ids`."""
    B, _ = segment_ids_BxL.shape
    new_run_BxL = jnp.concatenate(
        [jnp.ones((B, 1), bool), segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1
    )
    run_BxL = jnp.cumsum(new_run_BxL, axis=1, dtype=jnp.int32) - 1
    runs_B = run_BxL[:, -1] + 1
    slot_M = jnp.arange(max_segments, dtype=jnp.int32)
    lengths_BxM = jnp.sum(run_BxL[:, :, None] == slot_M, axis=1, dtype=jnp.int32)
    starts_BxM = jnp.cumsum(lengths_BxM, axis=1, dtype=jnp.int32) - lengths_BxM
    used_BxM = slot_M < runs_B[:, None]
    lengths_BxM = jnp.where(used_BxM, lengths_BxM, -1)
    starts_BxM1 = jnp.pad(jnp.where(used_BxM, starts_BxM, -1), ((0, 0), (0, 1)), constant_values=-1)
    return DocumentSpans(lengths_BxM, starts_BxM1, runs_B > max_segments)


def rows_whole(x: jax.Array) -> jax.Array:
    """[B, ...] split over the batch axes as the batch is, every other axis whole: cuDNN's
    partitioner hands each device the document spans of its own rows."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(BATCH_AXES, *[None] * (x.ndim - 1)))


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity without a key (evaluation) or at rate 0."""
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def attend(
    kernel: str,
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    layout: Any,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """Causal attention within documents by `kernel`; `layout` (a `PackedLayout`) carries what
    that kernel reads: the mask, the segment ids or the document spans."""
    if kernel == "cudnn_packed":
        planned = planned_device_facts() is not None  # a plan assumes a fixed jax (0.11.2+)
        mode = (
            "native"
            if planned
            else probe("cudnn_packed", q_BxLxHxK.dtype.name, q_BxLxHxK.shape[-1], 0)
        )
        return cudnn_packed_attention(
            q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, layout.spans, repeat_kv=mode == "repeat_kv"
        )
    if kernel == "pallas":
        return pallas_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, layout.segment_ids)
    if kernel in ("xla_dropout", "xla_written"):  # written out: rate 0 unless training
        return dropout_attention(
            q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, layout.mask, dropout_rate, dropout_key
        )
    # xla (mask or causal), cudnn (rows of one document: causal, no mask), cudnn_mask (the
    # document mask as a dense bias, causal tiles skipped)
    return jax.nn.dot_product_attention(
        q_BxLxHxK,
        k_BxLxGxK,
        v_BxLxGxK,
        mask=layout.mask,
        is_causal=layout.mask is None or kernel == "cudnn_mask",
        implementation="xla" if kernel == "xla" else "cudnn",
    )


def dropout_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask, rate: float, key) -> jax.Array:
    """Attention written out in XLA so its probabilities can be dropped (as nanoGPT does): fp32
    softmax, a fresh mask from `key` each step. `mask` [B,1,L,L], or None: causal."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
    logits = jnp.einsum(
        "blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxLxGxK, preferred_element_type=jnp.float32
    )
    allowed = jnp.tril(jnp.ones((L, L), bool)) if mask is None else mask[:, :, None]
    logits = jnp.where(allowed, logits * K**-0.5, jnp.finfo(jnp.float32).min)
    probs = dropout(jax.nn.softmax(logits, axis=-1), rate, key)
    out = jnp.einsum(
        "bgrls,bsgk->blgrk",
        probs.astype(v_BxLxGxK.dtype),
        v_BxLxGxK,
        preferred_element_type=jnp.float32,
    )
    return out.reshape(B, L, H, K).astype(q_BxLxHxK.dtype)


def cudnn_packed_attention(
    q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, spans: DocumentSpans, repeat_kv: bool = False
) -> jax.Array:
    """cuDNN over the documents of each row (causal within each). A row holding more documents
    than its spans have slots would leave tokens unwritten: its output is NaN instead, so the
    loss says so (the packers never make such rows; `attention.check_documents_per_row`)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    if repeat_kv:
        k_BxLxGxK, v_BxLxGxK = _repeat_heads(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    out = cudnn.dot_product_attention(
        q_BxLxHxK,
        k_BxLxGxK,
        v_BxLxGxK,
        q_seqlen=spans.lengths,
        kv_seqlen=spans.lengths,
        q_offsets=spans.starts,
        kv_offsets=spans.starts,
        scale=q_BxLxHxK.shape[-1] ** -0.5,
        mask_type=cudnn.MaskType.PADDING_CAUSAL,
    )
    return jnp.where(spans.overflow[:, None, None, None], jnp.nan, out).astype(out.dtype)


def pallas_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, sharded: bool = True):
    """Pallas (Triton) flash attention with segment ids; run per shard of the mesh, since a
    Pallas call has no partitioning rule (GSPMD would gather the whole batch onto each device).
    Off a GPU it runs in Pallas' interpreter (tests)."""
    pallas_gpu = pallas_gpu_attention()
    k_BxLxHxK, v_BxLxHxK = _repeat_heads(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    block = pallas_block(q_BxLxHxK.shape[1])
    backward = min(block, 64)  # not Pallas' default 32: faster on an H200 (BENCHMARKS.md)
    call = functools.partial(
        pallas_gpu.mha,
        sm_scale=q_BxLxHxK.shape[-1] ** -0.5,
        causal=True,
        block_sizes=pallas_gpu.BlockSizes(block, block, backward, backward, backward, backward),
        interpret=not _compiles_for_gpu(),
    )
    if not sharded:
        return call(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL)
    return _per_shard(call, q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL)


# jax 0.12's warning at the import of its Pallas attention module (absent in 0.10.2)
PALLAS_DEPRECATION = r"jax\.experimental\.pallas\.ops\.gpu\.attention is deprecated"


@functools.cache  # imported once: the warning filter is changed only around that import
def pallas_gpu_attention() -> Any:
    """jax's Pallas (Triton) attention module, imported without jax 0.12's deprecation warning:
    nothing a run can act on (its successor is another package), and under `-W error` it would
    end the run. When jax removes the module, the probe reports the kernel unavailable and the
    next kernel runs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", PALLAS_DEPRECATION, DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention

    return attention


def pallas_block(length: int) -> int:
    """The Pallas kernel's query/key block: the largest of 128, 64, 32, 16 dividing `length`
    (0: none does, the kernel cannot run)."""
    return next((b for b in (128, 64, 32, 16) if length % b == 0), 0)


def _repeat_heads(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK):
    groups = q_BxLxHxK.shape[2] // k_BxLxGxK.shape[2]
    return jnp.repeat(k_BxLxGxK, groups, axis=2), jnp.repeat(v_BxLxGxK, groups, axis=2)


def _per_shard(call, q, k, v, segment_ids):
    """`call` under `shard_map` on the context mesh: rows split as the batch is, heads over
    `tensor` where they divide, sequence and head dim whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return call(q, k, v, segment_ids)
    rows = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1) or None
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and q.shape[2] % tensor == 0 else None
    qkv = PartitionSpec(rows, None, heads, None)
    return jax.shard_map(
        call,
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, PartitionSpec(rows, None)),
        out_specs=qkv,
        check_vma=False,
    )(q, k, v, segment_ids)


# ----------------------------------------------------------------------------- probes


def works(kernel: str, dtype, head_dim: int, length: int) -> bool:
    """Whether `kernel` runs correctly here at this dtype, head dim and row length (guarded
    kernels are probed once; the public ones always run)."""
    if kernel not in ("cudnn_packed", "pallas") or planned_device_facts() is not None:
        return True  # public kernels; and a plan for a GPU that is not here cannot probe it
    block = pallas_block(length) if kernel == "pallas" else 0
    return probe(kernel, jnp.dtype(dtype).name, head_dim, block) is not None


@functools.cache  # a fact about this process's jax and device: found once, then reused
def probe(kernel: str, dtype_name: str, head_dim: int, block: int) -> str | None:
    """Whether a guarded kernel runs correctly here: cudnn_packed answers `native` or
    `repeat_kv` (grouped-query offsets wrong in this jax), pallas `native`; None (after one
    printed line) where it is missing, has moved, fails or is wrong, so the next kernel runs."""
    problem = _api_problem(kernel)
    if problem is None:
        try:
            mode = _numeric_probe(kernel, jnp.dtype(dtype_name), head_dim, block)
        except Exception as err:  # a private API may fail in any way: never fail the run
            mode, problem = None, f"failed its self-test ({first_line(err)})"
        else:
            problem = None if mode else "gave wrong numbers in its self-test against XLA"
        if mode == "repeat_kv":
            _say(
                "attention: this jax's cuDNN packed-document kernel misplaces grouped-query "
                "K/V heads (fixed by jax PR #39521); repeating K/V heads for it"
            )
    if problem is not None:
        _say(f"attention: {kernel} unavailable here ({problem}); using the next kernel")
        return None
    return mode


def _api_problem(kernel: str) -> str | None:
    """What is missing from the private/experimental API a guarded kernel calls, or None."""
    try:
        if kernel == "cudnn_packed":
            from jax._src.cudnn import fused_attention_stablehlo as module

            function, needed = module.dot_product_attention, _CUDNN_PACKED_PARAMS
            if not hasattr(module.MaskType, "PADDING_CAUSAL"):
                return f"{module.__name__}.MaskType has no PADDING_CAUSAL"
            where = f"{module.__name__}.dot_product_attention"
        else:
            module = pallas_gpu_attention()
            function, needed = module.mha, _PALLAS_PARAMS
            module.BlockSizes(128, 128, 64, 64, 64, 64)
            where = f"{module.__name__}.mha"
        missing = needed - set(inspect.signature(function).parameters)
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        return first_line(err)
    return f"{where} has no {', '.join(sorted(missing))}" if missing else None


def _numeric_probe(kernel: str, dtype, head_dim: int, block: int) -> str | None:
    """Output and input gradients of `kernel` on a small packed batch (4 query heads, 2 K/V
    heads, up to three documents and padding per row) against XLA with the mask in float32;
    Pallas with the blocks it will use (`block`), cuDNN on rows of 256."""
    length = 8 * block if block else 256
    rng = np.random.default_rng(0)
    q, k, v, cotangent = (
        rng.standard_normal((2, length, heads, head_dim)).astype(np.float32)
        for heads in (4, 2, 2, 4)
    )
    cut = length // 8
    ids = np.repeat([[1, 2, 3, 0], [4, 5, 5, 0]], [3 * cut, 2 * cut, 2 * cut, cut], axis=1)
    ids = ids.astype(np.int32)
    mask = (ids[:, None, :, None] == ids[:, None, None, :]) & np.tri(length, dtype=bool)

    def compare(q, k, v, cotangent, ids, mode):
        def candidate(q, k, v):
            q, k, v = (x.astype(dtype) for x in (q, k, v))
            if kernel == "pallas":
                return pallas_attention(q, k, v, ids, sharded=False)
            spans = document_spans(ids, 4)
            return cudnn_packed_attention(q, k, v, spans, repeat_kv=mode == "repeat_kv")

        want = _outputs_and_grads(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask), q, k, v, cotangent
        )
        return want, _outputs_and_grads(candidate, q, k, v, cotangent)

    close = functools.partial(np.allclose, atol=4 * _PROBE_TOLERANCE, rtol=_PROBE_TOLERANCE)
    for mode in ("native",) if kernel == "pallas" else ("native", "repeat_kv"):
        # compiled and run outside whatever trace asks (the first forward pass of a step)
        run = jax.jit(functools.partial(compare, mode=mode))
        want, got = run.lower(q, k, v, cotangent, ids).compile()(q, k, v, cotangent, ids)
        if all(close(np.asarray(a), np.asarray(b)) for a, b in zip(got, want, strict=True)):
            return mode
    return None


def _outputs_and_grads(attention, q, k, v, cotangent) -> list[jax.Array]:
    """attention(q, k, v) and the gradients of <out, cotangent> wrt q, k, v, in float32."""

    def loss(q, k, v):
        out = attention(q, k, v).astype(jnp.float32)
        return jnp.sum(out * cotangent), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return [x.astype(jnp.float32) for x in (out, *grads)]


def _say(line: str) -> None:
    if jax.process_index() == 0:
        print(f"warning: {line}", file=sys.stderr, flush=True)
