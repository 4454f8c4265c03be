"""Which attention kernel runs, decided in one pure function of plain facts (so a CPU test covers
every branch), and the words the run's first line uses for it.

`model.attention=auto`, for a forward pass that drops nothing (evaluation, or model.dropout=0):

| rows | NVIDIA cc 9.0+, bf16/fp16 | cc 8.x, bf16/fp16 | cc 7.x fp16, CPU, TPU, fp32 |
|---|---|---|---|
| one document each (no segment ids) | cudnn | cudnn | xla |
| packed documents | cudnn_packed > pallas > cudnn_mask > xla | pallas > cudnn_mask > xla | xla |

`a > b`: a where it works here (the guarded kernels are probed once, `kernels.probe`), else b.
`cudnn_packed` needs the bound on documents per row (`data.max_docs_per_row`: the packers keep
it); pipeline stages run packed rows on XLA (jax's cuDNN batching rule cannot take the per-row
document spans under the stage `vmap`). A training pass with model.dropout > 0 runs
`xla_dropout` everywhere: only attention written out in XLA can drop probabilities with a fresh
mask each step (cuDNN's private API takes one static integer seed). bf16 on a GPU before cc 8.0
runs `xla_written`, the same attention written out: jax's XLA attention asks for a bf16 dot
algorithm that XLA's GPU compiler refuses there ("Unsupported algorithm ... ALG_DOT_BF16_BF16_F32").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from input_pipeline.errors import DataError
from trainer.errors import ConfigError
from trainer.models import kernels

Kernel = Literal[
    "xla", "xla_dropout", "xla_written", "cudnn", "cudnn_mask", "cudnn_packed", "pallas"
]
_HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclass(frozen=True)
class AttentionFacts:
    """Everything the kernel choice depends on: the device, the numerics and the batch."""

    platform: str  # cpu, gpu, tpu
    compute_capability: str | None  # a CUDA device's, e.g. "9.0"
    compute_dtype: Any
    head_dim: int
    seq_len: int
    packed: bool  # rows carry segment ids (several documents per row)
    dropout: float = 0.0  # the rate this forward pass applies (0 when evaluating)
    max_docs_per_row: int | None = None  # the bound rows keep; None: unknown
    pipelined: bool = False  # layers run in pipeline stages (under a `vmap`)


def choose_attention(
    requested: str, facts: AttentionFacts, works: Callable[[str], bool] = lambda kernel: True
) -> Kernel:
    """`model.attention` (auto | xla | cudnn) resolved for `facts`; `works(kernel)` says whether
    a guarded kernel passed its probe here. A forced `cudnn` that cannot run is a config error,
    not a crash inside the kernel."""
    problem = _cudnn_problem(facts)
    if requested == "cudnn" and problem:
        raise ConfigError(
            "model.attention=cudnn needs an NVIDIA GPU with compute capability 8.0+ and "
            f"bf16/fp16 compute; this run has {problem}; use model.attention=auto or xla"
        )
    if facts.dropout > 0:
        return "xla_dropout"
    if requested == "xla" or problem:
        refused = bf16_dots_refused(facts.platform, facts.compute_capability, facts.compute_dtype)
        return "xla_written" if refused else "xla"
    if not facts.packed:
        return "cudnn"
    return next(k for k in _packed_preference(requested, facts) if works(k))


def bf16_dots_refused(platform: str, compute_capability: str | None, dtype: Any) -> bool:
    """bf16 on a CUDA GPU before Ampere: XLA's GPU compiler refuses there the bf16 x bf16 ->
    fp32 dot algorithm that jax's XLA attention asks for, so attention is written out."""
    capability = parse_capability(compute_capability)
    bf16 = jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
    return platform == "gpu" and capability is not None and capability < (8, 0) and bf16


def precision_warning(compute: str, device: Any) -> str | None:
    """A line for bf16 compute on a device `bf16_dots_refused` names (a GPU before Ampere, which
    has no bf16 tensor cores): float16 is the precision that uses them (README, "Precision").
    `device`: a `jax.Device`, or the plan's `Gpu`. None elsewhere."""
    capability = getattr(device, "compute_capability", None)
    if not bf16_dots_refused(device.platform, capability, compute):
        return None
    return (
        f"warning: precision.compute=bfloat16 on {device.device_kind} (compute capability "
        f"{capability}), which has no bf16 tensor cores: its matmuls run at fp32 speed or "
        "slower; set precision.compute=float16 for its tensor cores (its loss is scaled for you)"
    )


def _packed_preference(requested: str, facts: AttentionFacts) -> list[Kernel]:
    """Kernels for packed rows on a GPU where cuDNN runs, fastest first (H200 figures in
    BENCHMARKS.md); the last one always runs."""
    if facts.pipelined:
        return ["xla"]
    capability = parse_capability(facts.compute_capability) or (0, 0)
    preference: list[Kernel] = []
    if capability >= (9, 0) and facts.max_docs_per_row is not None:
        preference.append("cudnn_packed")
    pallas_runs = kernels.pallas_block(facts.seq_len) and _power_of_two(facts.head_dim)
    if requested == "auto" and pallas_runs:
        preference.append("pallas")
    if facts.seq_len % 2 == 0:  # cuDNN's backward with a bias needs even lengths
        preference.append("cudnn_mask")
    return [*preference, "xla"]


def device_facts() -> tuple[str, str | None]:
    """The backend platform (`cpu`, `gpu`, `tpu`) and, on a CUDA device, its compute capability;
    inside `planned_device`, those of the GPU `trainer.plan --gpu` compiles for."""
    planned = kernels.planned_device_facts()
    if planned is not None:
        return planned
    device = jax.devices()[0]
    return device.platform, getattr(device, "compute_capability", None)


def facts_here(spec: Any, seq_len: int, packed: bool, training: bool) -> AttentionFacts:
    """The facts of a forward pass of the built-in transformer (`spec`) on this process's
    devices."""
    platform, compute_capability = device_facts()
    return AttentionFacts(
        platform=platform,
        compute_capability=compute_capability,
        compute_dtype=spec.compute_dtype,
        head_dim=spec.head_dim,
        seq_len=seq_len,
        packed=packed,
        dropout=spec.dropout if training else 0.0,
        max_docs_per_row=spec.max_docs_per_row,
        pipelined=spec.pipeline is not None,
    )


def attention_kernel(requested: str, facts: AttentionFacts) -> Kernel:
    """`choose_attention` with the guarded kernels probed on this process's device."""
    return choose_attention(
        requested,
        facts,
        lambda kernel: kernels.works(kernel, facts.compute_dtype, facts.head_dim, facts.seq_len),
    )


def check_requested(requested: str, compute_dtype, head_dim: int) -> None:
    """A forced `model.attention` that cannot run on this device and dtype: a `ConfigError` at
    model build, not a crash at the first step's compile."""
    platform, compute_capability = device_facts()
    facts = AttentionFacts(platform, compute_capability, compute_dtype, head_dim, 2, packed=False)
    choose_attention(requested, facts)


def attention_dtype(compute_dtype) -> jnp.dtype:
    """The dtype attention runs in: the compute dtype, except float16 on CPU, where XLA has no
    fp16 x fp16 -> fp32 dot for jax's attention logits (fp16 on CPU is for tests only)."""
    if jnp.dtype(compute_dtype) == jnp.float16 and device_facts()[0] == "cpu":
        return jnp.dtype(jnp.float32)
    return jnp.dtype(compute_dtype)


def attention_banner(requested: str, facts: AttentionFacts) -> str:
    """What the run's first line says about attention, e.g. `attention xla (packed rows, cpu,
    float32)`; a training pass that drops probabilities is named apart."""
    evaluating = replace(facts, dropout=0.0)
    kernel = attention_kernel(requested, evaluating)
    device = facts.platform
    if facts.platform == "gpu" and facts.compute_capability:
        device = f"gpu cc {facts.compute_capability}"
    rows = "packed rows" if facts.packed else "one document per row"
    line = f"attention {kernel} ({rows}, {device}, {jnp.dtype(facts.compute_dtype).name})"
    if facts.dropout > 0:
        line += f", xla_dropout while training (model.dropout={facts.dropout:g})"
    return line


def run_attention_note(config: Any) -> str:
    """`; attention ...` for the run's first line: the kernel the built-in transformer runs at
    the configured shapes (its `ModelSpec.startup_note`; a caller's or an imported model has
    none, its attention is its own)."""
    model = config.model
    platform, compute_capability = device_facts()
    facts = AttentionFacts(
        platform=platform,
        compute_capability=compute_capability,
        compute_dtype=config.precision.compute,
        head_dim=model.head_dim or model.d_model // model.num_heads,
        seq_len=config.data.seq_len,
        packed=True,  # the packers always give segment ids
        dropout=model.dropout,
        max_docs_per_row=config.data.resolved_max_docs_per_row,
        pipelined=config.mesh.stage > 1,
    )
    return f"; {attention_banner(model.attention, facts)}"


def check_documents_per_row(segment_ids_BxL: np.ndarray, max_docs_per_row: int) -> None:
    """Host-side check of a caller's batch: the cuDNN packed kernel takes at most
    `max_docs_per_row` documents plus one padding run per row (the packers keep that bound)."""
    ids = np.asarray(segment_ids_BxL)
    runs = 1 + np.count_nonzero(ids[:, 1:] != ids[:, :-1], axis=1)
    worst = int(runs.max(initial=0))
    if worst > max_docs_per_row + 1:
        raise DataError(
            f"a batch row holds {worst} runs of equal segment_ids, more than "
            f"data.max_docs_per_row={max_docs_per_row} documents and one padding run; raise "
            f"data.max_docs_per_row to {worst - 1}, or pack fewer documents per row"
        )


class CheckedBatches:
    """A caller's batch iterator whose rows are checked by `check_documents_per_row` as they
    pass; anything else (a Grain iterator's `get_state`/`set_state`) goes to the iterator."""

    def __init__(self, batches: Iterable[dict], max_docs_per_row: int):
        self._batches = iter(batches)
        self._bound = max_docs_per_row

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        batch = next(self._batches)
        if "segment_ids" in batch:
            check_documents_per_row(batch["segment_ids"], self._bound)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batches, name)


def _cudnn_problem(facts: AttentionFacts) -> str | None:
    """What stops cuDNN flash attention here (the checks of `jax._src.cudnn`), or None."""
    capability = parse_capability(facts.compute_capability) if facts.platform == "gpu" else None
    if capability is None:
        gpu = facts.platform == "gpu"
        return "a GPU without a CUDA compute capability" if gpu else facts.platform
    if capability < (8, 0):
        return f"a GPU of compute capability {facts.compute_capability}"
    dtype = jnp.dtype(facts.compute_dtype)
    if dtype not in _HALF_DTYPES:
        return f"{dtype.name} compute"
    max_head_dim = 256 if capability >= (9, 0) else 128
    if facts.head_dim % 8 or facts.head_dim > max_head_dim:
        return f"head dim {facts.head_dim} (cuDNN needs a multiple of 8 up to {max_head_dim})"
    return None


def parse_capability(compute_capability: str | None) -> tuple[int, int] | None:
    """`"9.0"` as `(9, 0)`; None for anything else (no capability, a malformed one)."""
    try:
        major, minor = str(compute_capability).split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def _power_of_two(n: int) -> bool:
    return 16 <= n <= 256 and n & (n - 1) == 0
