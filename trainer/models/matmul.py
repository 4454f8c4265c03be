"""A bfloat16 matmul whose backward pass is bfloat16 too.

Mixed precision means every matmul reads bf16 operands and accumulates in float32: what GPU
tensor cores and TPU MXUs do natively. Left to autodiff, a `Linear` under bf16 compute does not
stay there on XLA:CPU: a bf16 x bf16 -> bf16 dot is rewritten into an f32 dot (float
normalization), and the transpose of a dot that accumulates in f32 multiplies an f32 cotangent
by a bf16 operand, again an f32 dot. An explicit VJP keeps all three matmuls of a layer (forward,
input gradient, weight gradient) as bf16 operands with f32 accumulation, each rounded to bf16 —
the same numbers a GPU computes. On this 2-core CPU it made the nanoGPT-sized step ~20% faster
(BENCHMARKS.md).

Remat policies that pick values by primitive (`save_dots`) cannot see inside a custom VJP, so
the built-in model uses this only where no such policy is set (`TransformerSpec.dot_general`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BF16 = jnp.dtype(jnp.bfloat16)


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
        return _bf16_linear(lhs, rhs)
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
