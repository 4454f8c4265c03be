"""Which attention kernel runs, decided in one pure function of plain facts (so a CPU test covers
every branch): cuDNN flash attention on NVIDIA GPUs of compute capability 8.0+ with bf16/fp16
compute, XLA everywhere else.

cuDNN runs only rows of one document each (`is_causal=True`, no mask): jax's public
`jax.nn.dot_product_attention(implementation="cudnn")` takes no segment ids or offsets and turns
a `mask` into a dense [B, 1, L, L] bias; the packed-row offsets of `jax._src.cudnn` are private
and Hopper-only. So a batch that carries `segment_ids` (packed rows) runs XLA with the mask.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from trainer.errors import ConfigError

Implementation = Literal["xla", "cudnn"]
_HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def device_facts() -> tuple[str, str | None]:
    """The backend platform (`cpu`, `gpu`, `tpu`) and, on a CUDA device, its compute capability."""
    device = jax.devices()[0]
    return device.platform, getattr(device, "compute_capability", None)


def choose_attention(
    requested: str,
    *,
    platform: str,
    compute_capability: str | None,
    compute_dtype,
    head_dim: int,
    packed: bool,
) -> Implementation:
    """`model.attention` (auto | xla | cudnn) resolved for this device, dtype and batch layout;
    a forced `cudnn` that cannot run here is a config error, not a crash inside the kernel."""
    if requested == "xla":
        return "xla"
    problem = _cudnn_problem(platform, compute_capability, compute_dtype, head_dim)
    if requested == "cudnn" and problem:
        raise ConfigError(
            "model.attention=cudnn needs an NVIDIA GPU with compute capability 8.0+ and "
            f"bf16/fp16 compute; this run has {problem}; use model.attention=auto or xla"
        )
    return "xla" if problem or packed else "cudnn"


def attention_implementation(
    requested: str, compute_dtype, head_dim: int, packed: bool
) -> Implementation:
    """`choose_attention` on the devices of this process."""
    platform, compute_capability = device_facts()
    return choose_attention(
        requested,
        platform=platform,
        compute_capability=compute_capability,
        compute_dtype=compute_dtype,
        head_dim=head_dim,
        packed=packed,
    )


def attention_dtype(compute_dtype) -> jnp.dtype:
    """The dtype attention runs in: the compute dtype, except float16 on CPU, where XLA has no
    fp16 x fp16 -> fp32 dot for jax's attention logits (fp16 on CPU is for tests only)."""
    if jnp.dtype(compute_dtype) == jnp.float16 and device_facts()[0] == "cpu":
        return jnp.dtype(jnp.float32)
    return jnp.dtype(compute_dtype)


def _cudnn_problem(
    platform: str, compute_capability: str | None, compute_dtype, head_dim: int
) -> str | None:
    """What stops cuDNN flash attention here (the checks of `jax._src.cudnn`), or None."""
    capability = _parse_capability(compute_capability) if platform == "gpu" else None
    if capability is None:
        return platform if platform != "gpu" else "a GPU without a CUDA compute capability"
    if capability < (8, 0):
        return f"a GPU of compute capability {compute_capability}"
    if jnp.dtype(compute_dtype) not in _HALF_DTYPES:
        return f"{jnp.dtype(compute_dtype).name} compute"
    max_head_dim = 256 if capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > max_head_dim:
        return f"head dim {head_dim} (cuDNN needs a multiple of 8 up to {max_head_dim})"
    return None


def _parse_capability(compute_capability: str | None) -> tuple[int, int] | None:
    try:
        major, minor = str(compute_capability).split(".")
        return int(major), int(minor)
    except ValueError:
        return None
