"""The bf16 matmul with an explicit VJP: autodiff's gradients, every matmul in bf16."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from trainer.models.matmul import mixed_precision_dot_general

LINEAR = (((2,), (0,)), ((), ()))  # x[B, L, K] @ w[K, N], as nnx.Linear calls it


def operands(seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (3, 5, 16), jnp.float32)
    w = jax.random.normal(kw, (16, 8), jnp.float32) / 4
    probe = jax.random.normal(kg, (3, 5, 8), jnp.float32)
    return x, w, probe


def loss(dot_general, x, w, probe):
    out = dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), LINEAR)
    return jnp.sum(out.astype(jnp.float32) * probe)


def test_gradients_match_autodiff_within_bf16_rounding():
    x, w, probe = operands()
    ours = jax.grad(loss, argnums=(1, 2))(mixed_precision_dot_general, x, w, probe)
    reference = jax.grad(loss, argnums=(1, 2))(jax.lax.dot_general, x, w, probe)
    exact = jax.grad(lambda x, w: jnp.sum((x @ w) * probe), argnums=(0, 1))(x, w)
    for got, want, true in zip(ours, reference, exact, strict=True):
        # both round operands and results to bf16 (8 bits of mantissa): ~1% of the exact value
        np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)
        assert float(jnp.max(jnp.abs(got - true))) < 0.03 * float(jnp.max(jnp.abs(true)))


def test_every_matmul_of_the_gradient_reads_bf16():
    """Forward, input gradient and weight gradient: bf16 operands, f32 accumulation. Asking
    autodiff for f32 accumulation instead gives backward matmuls of an f32 cotangent."""
    x, w, probe = operands()

    def f32_accumulating(lhs, rhs, dims):
        return jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32).astype(
            lhs.dtype
        )

    def dots(dot_general):
        grads = jax.grad(lambda x, w: loss(dot_general, x, w, probe), argnums=(0, 1))
        found = []

        def visit(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "dot_general":
                    operands = tuple(v.aval.dtype.name for v in eqn.invars)
                    found.append((operands, jnp.dtype(eqn.params["preferred_element_type"]).name))
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    visit(sub)

        visit(jax.make_jaxpr(grads)(x, w).jaxpr)
        return found

    assert dots(mixed_precision_dot_general) == [(("bfloat16", "bfloat16"), "float32")] * 3
    assert any("float32" in operands for operands, _ in dots(f32_accumulating))


def test_float32_and_other_contractions_are_plain_dots():
    x, w, _ = operands()
    np.testing.assert_array_equal(
        mixed_precision_dot_general(x, w, LINEAR), jax.lax.dot_general(x, w, LINEAR)
    )
    x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    wide = mixed_precision_dot_general(x16, w16, LINEAR, preferred_element_type=jnp.float32)
    assert wide.dtype == jnp.float32  # the caller's result dtype is kept
    np.testing.assert_array_equal(
        wide, jax.lax.dot_general(x16, w16, LINEAR, preferred_element_type=jnp.float32)
    )
    batched = (((2,), (1,)), ((0,), (0,)))
    y = jnp.ones((3, 16, 8), jnp.bfloat16)
    np.testing.assert_array_equal(
        mixed_precision_dot_general(x.astype(jnp.bfloat16), y, batched),
        jax.lax.dot_general(x.astype(jnp.bfloat16), y, batched),
    )
