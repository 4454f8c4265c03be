"""A bfloat16 matmul whose backward pass is bfloat16 too, for the backend that needs it.

Mixed precision means every matmul reads bf16 operands and accumulates in float32: what GPU
tensor cores and TPU MXUs do natively, under plain autodiff too. XLA:CPU does not stay there: a
bf16 x bf16 -> bf16 dot is rewritten into an f32 dot (float normalization), and the transpose of a
dot that accumulates in f32 multiplies an f32 cotangent by a bf16 operand, again an f32 dot. An
explicit VJP keeps all three matmuls of a layer (forward, input gradient, weight gradient) as bf16
operands with f32 accumulation, each rounded to bf16 — the same numbers a GPU computes — and is
faster on CPU (BENCHMARKS.md, "bf16 backward matmuls"); `linear_dot_general` picks it there only.

Its output is tagged `BF16_DOT`, so a remat policy can save it by name (`model.remat=save_dots`):
a policy that picks values by primitive cannot see the dot inside a custom VJP.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

_BF16 = jnp.dtype(jnp.bfloat16)
BF16_DOT = "bf16_dot"  # the checkpoint name of the explicit-VJP matmul's output
DotGeneral = Callable[..., jax.Array]


def linear_dot_general(platform: str) -> DotGeneral:
    """The matmul of dense layers on `platform`: the explicit VJP on CPU, where it is measured to
    help; plain `dot_general` on GPU/TPU, whose autodiff already keeps bf16 backward dots."""
    return mixed_precision_dot_general if platform == "cpu" else jax.lax.dot_general


def mixed_precision_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    **kwargs,
) -> jax.Array:
    """Drop-in `dot_general` for `nnx.Linear`: `x[..., K] @ w[K, N]` in bf16 with a bf16 result
    takes the explicit VJP; anything else (float32 compute, other contractions, a caller asking
    for another result dtype) is plain `jax.lax.dot_general`."""
    linear = dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ()))
    bf16_result = preferred_element_type is None or jnp.dtype(preferred_element_type) == _BF16
    if linear and bf16_result and lhs.dtype == _BF16 and rhs.dtype == _BF16 and rhs.ndim == 2:
        return checkpoint_name(_bf16_linear(lhs, rhs), BF16_DOT)
    return jax.lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        **kwargs,
    )


def _dot(a: jax.Array, b: jax.Array, contract_a: tuple, contract_b: tuple, out_dtype) -> jax.Array:
    dims = ((contract_a, contract_b), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out_dtype)


@jax.custom_vjp
def _bf16_linear(x_NxK: jax.Array, w_KxM: jax.Array) -> jax.Array:
    return _dot(x_NxK, w_KxM, (x_NxK.ndim - 1,), (0,), x_NxK.dtype)


def _bf16_linear_fwd(x_NxK, w_KxM):
    return _bf16_linear(x_NxK, w_KxM), (x_NxK, w_KxM)


def _bf16_linear_bwd(residuals, grad_NxM):
    x_NxK, w_KxM = residuals  # grad_NxM is bf16 already: the primal result's dtype
    grad_x = _dot(grad_NxM, w_KxM, (grad_NxM.ndim - 1,), (1,), x_NxK.dtype)
    rows = tuple(range(x_NxK.ndim - 1))  # every leading (batch, length) axis
    grad_w = _dot(x_NxK, grad_NxM, rows, rows, w_KxM.dtype)
    return grad_x, grad_w


_bf16_linear.defvjp(_bf16_linear_fwd, _bf16_linear_bwd)
