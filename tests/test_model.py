"""The built-in transformer and the model seam: shapes, packing isolation, registry, import path."""

import functools
import sys
import textwrap

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.models import build_model

SMALL = [
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.d_ff=64",
]


def make(overrides=(), compute="float32", vocab=64, max_docs_per_row=None):
    """The small model; `max_docs_per_row` is the bound on documents per row the trainer passes."""
    config = load_config(None, [*SMALL, *overrides])
    return build_model(
        config.model,
        vocab_size=vocab,
        rngs=nnx.Rngs(0),
        compute_dtype=compute,
        param_dtype="float32",
        max_docs_per_row=max_docs_per_row,
    )


def batch_of(tokens, segment_ids=None):
    tokens = jnp.asarray(tokens, jnp.int32)
    if segment_ids is None:
        segment_ids = jnp.ones_like(tokens)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    # positions restart at 0 at each document start
    positions = np.zeros(tokens.shape, np.int32)
    for b in range(tokens.shape[0]):
        for i in range(1, tokens.shape[1]):
            same = segment_ids[b, i] == segment_ids[b, i - 1]
            positions[b, i] = positions[b, i - 1] + 1 if same else 0
    return {"inputs": tokens, "segment_ids": segment_ids, "positions": jnp.asarray(positions)}


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("extra", [[], ["model.tie_embeddings=true"], ["model.remat=full"]])
def test_logits_shape_and_dtype(compute, extra):
    model = make(extra, compute)
    logits = model(batch_of(np.arange(2 * 16).reshape(2, 16) % 64))
    assert logits.shape == (2, 16, 64)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_parameters_are_float32_and_stacked_by_layer():
    model = make(["model.num_layers=3"], compute="bfloat16")
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree.leaves(params)
    assert all(x.dtype == jnp.float32 for x in leaves)
    assert params["blocks"]["attn"]["q"]["kernel"].shape[0] == 3


def test_every_parameter_has_logical_axes():
    """Unannotated parameters end up replicated and recompile the step: none allowed."""
    model = make()
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    for path, spec in jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]:
        value = spec.get_value()
        assert len(value) > 0 and all(a is not None for a in value), path


def test_causal_and_packed_documents_do_not_leak():
    """In a packed row, one document's logits ignore the other document and the future."""
    model = make()
    segments = [[1] * 6 + [2] * 10]
    base = np.arange(16)[None] % 64
    changed_doc2 = base.copy()
    changed_doc2[0, 8:] = (changed_doc2[0, 8:] + 7) % 64
    out_a = model(batch_of(base, segments))
    out_b = model(batch_of(changed_doc2, segments))
    np.testing.assert_allclose(out_a[0, :6], out_b[0, :6], atol=1e-6)  # doc 1 untouched
    np.testing.assert_allclose(out_a[0, 6:8], out_b[0, 6:8], atol=1e-6)  # doc 2 before change
    assert not np.allclose(out_a[0, 8:], out_b[0, 8:])


def test_document_position_is_what_counts():
    """A document gives the same logits alone or packed after another one (rotary positions)."""
    model = make()
    doc = np.array([5, 9, 2, 7, 1, 3])
    alone = model(batch_of(doc[None]))
    packed = model(batch_of(np.concatenate([[1, 2, 3, 4], doc])[None], [[1] * 4 + [2] * 6]))
    np.testing.assert_allclose(alone[0], packed[0, 4:], atol=1e-5)


def test_remat_does_not_change_values():
    batch = batch_of(np.arange(16)[None] % 64)
    outs = [make([f"model.remat={r}"])(batch) for r in ("none", "full", "save_dots")]
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-6)
    np.testing.assert_allclose(outs[0], outs[2], atol=1e-6)


def bf16_grad_of(remat: str):
    """The gradient function of a bf16 model under `remat`, and its parameters."""
    batch = batch_of(np.arange(32).reshape(2, 16) % 64)
    graphdef, params = nnx.split(make([f"model.remat={remat}"], "bfloat16"))
    return jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(batch) ** 2)), params


def test_bf16_gradients_agree_across_remat_policies():
    """Remat recomputes or saves the same bf16 matmuls (explicit VJP on CPU): same gradients."""
    none, full, save_dots = (
        grad(p) for grad, p in map(bf16_grad_of, ("none", "full", "save_dots"))
    )
    # Equal to float32 reassociation (XLA 0.12 fuses the saved and recomputed graphs apart:
    # 4e-6 relative); a bf16 rounding difference would be ~1e-3.
    same = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-8)
    jax.tree.map(same, none, full)
    jax.tree.map(same, none, save_dots)


def test_save_dots_saves_the_bf16_matmuls():
    """`model.remat=save_dots` keeps the outputs of the explicit-VJP matmuls (tagged by name; a
    dot policy cannot see inside a custom VJP): its gradient has as many weight matmuls (dots
    without batch dims) as no remat, `full` recomputes some, and every one reads bf16."""

    def weight_dots(remat):
        grad, params = bf16_grad_of(remat)
        found = []

        def visit(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "dot_general":
                    _, (lhs_batch_dims, _) = eqn.params["dimension_numbers"]
                    if not lhs_batch_dims:
                        found.append(tuple(v.aval.dtype.name for v in eqn.invars))
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    visit(sub)

        visit(jax.make_jaxpr(grad)(params).jaxpr)
        return found

    none, full, save_dots = map(weight_dots, ("none", "full", "save_dots"))
    assert len(save_dots) == len(none) < len(full)
    assert set(none + full + save_dots) == {("bfloat16", "bfloat16")}


def test_unrolled_layers_match_the_scan():
    """`model.scan_layers=false` runs the same stacked parameters (checkpoints stay
    interchangeable) through a plain loop: same logits and gradients as the scan."""
    batch = batch_of(np.arange(32).reshape(2, 16) % 64, [[1] * 9 + [2] * 7, [1] * 16])
    scanned, unrolled = make(), make(["model.scan_layers=false"])
    assert jax.tree.structure(nnx.state(scanned)) == jax.tree.structure(nnx.state(unrolled))

    def loss_and_grads(model):
        graphdef, params = nnx.split(model)
        return jax.value_and_grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(batch) ** 2))(params)

    (loss_s, grads_s), (loss_u, grads_u) = loss_and_grads(scanned), loss_and_grads(unrolled)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7)
    jax.tree.map(close, grads_s, grads_u)


LLAMA3 = "factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 4"


@pytest.mark.parametrize("kind", ["rope_type: llama3", "type: llama3, rope_type: llama3"])
def test_rope_kind_under_either_key_scales_alike(kind):
    tokens = np.arange(2 * 16).reshape(2, 16) % 64
    logits = make([f"model.rope_scaling={{{kind}, {LLAMA3}}}"])(batch_of(tokens))
    expected = make([f"model.rope_scaling={{type: llama3, {LLAMA3}}}"])(batch_of(tokens))
    np.testing.assert_array_equal(logits, expected)
    assert not np.allclose(logits, make()(batch_of(tokens)))


def test_a_model_spec_with_two_rope_kinds_is_refused_before_tracing():
    """A config built without validation (library use): it used to trace as llama3, then fail
    on a KeyError for low_freq_factor, a key the user never meant to set."""
    config = load_config(None, SMALL).model
    unchecked = config.model_copy(
        update={"rope_scaling": {"type": "linear", "rope_type": "llama3", "factor": 2.0}}
    )
    with pytest.raises(ConfigError, match="sets rope_type='llama3' and type='linear'; delete"):
        build_model(
            unchecked,
            vocab_size=64,
            rngs=nnx.Rngs(0),
            compute_dtype="float32",
            param_dtype="float32",
        )


def test_unknown_kind_names_the_fix():
    with pytest.raises(ConfigError, match="not a built-in model"):
        make(["model.kind=gpt5"])
    with pytest.raises(ConfigError, match="cannot import"):
        make(["model.kind=no_such_pkg.models:build"])


def test_import_path_model(tmp_path, monkeypatch):
    package = tmp_path / "user_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mlp.py").write_text(
        textwrap.dedent("""
        from flax import nnx

        class Bigram(nnx.Module):
            def __init__(self, vocab, rngs):
                init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed"))
                self.table = nnx.Embed(vocab, vocab, embedding_init=init, rngs=rngs)

            def __call__(self, batch):
                return self.table(batch["inputs"])

        def build(config, *, vocab_size, rngs, compute_dtype, param_dtype):
            return Bigram(vocab_size + config.args.get("extra", 0), rngs)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_models", raising=False)
    model = make(["model.kind=user_models.mlp:build", "model.args.extra=2"])
    assert model(batch_of(np.zeros((1, 4)))).shape == (1, 4, 66)


def test_an_import_path_factory_of_the_wrong_signature_is_one_line(tmp_path, monkeypatch):
    """Before: `TypeError: build() got an unexpected keyword argument 'vocab_size'` from inside
    the sharded init."""
    (tmp_path / "old_models.py").write_text("def build(config, rngs):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "old_models", raising=False)
    with pytest.raises(ConfigError, match=r"takes \(config, rngs\); a model factory takes"):
        make(["model.kind=old_models:build"])


class CallsWithTokens(nnx.Module):
    """A model whose call takes arrays, not the batch dict the default loss passes."""

    def __init__(self, rngs):
        self.table = nnx.Embed(64, 64, rngs=rngs)

    def __call__(self, inputs, positions):
        return self.table(inputs)


def test_the_default_loss_names_a_model_that_does_not_take_the_batch():
    """Before: a TypeError (missing argument 'positions') from inside the backward pass."""
    from trainer.step import next_token_loss

    tokens = np.zeros((2, 9), np.int32)
    batch = batch_of(tokens[:, :-1])
    batch["targets"], batch["weights"] = jnp.asarray(tokens[:, 1:]), jnp.ones((2, 8))
    with pytest.raises(ConfigError, match=r"takes \(inputs, positions\).*model\(batch\)"):
        next_token_loss(CallsWithTokens(nnx.Rngs(0)), batch)


@pytest.mark.parametrize("tied", [False, True])
def test_a_fresh_model_starts_near_the_loss_of_a_uniform_guess(tied):
    """With a GPT-2 sized vocabulary the first loss sits within 1.0 of ln V, tied or not (the
    tied embedding was initialised with std 1 and started at 513 at d_model 768)."""
    from trainer.step import next_token_loss

    vocab = 50304
    model = make([f"model.tie_embeddings={str(tied).lower()}", "model.d_model=64"], vocab=vocab)
    tokens = np.random.default_rng(0).integers(0, vocab, (2, 33))
    batch = batch_of(tokens[:, :-1])
    batch["targets"], batch["weights"] = jnp.asarray(tokens[:, 1:]), jnp.ones((2, 32))
    loss, _ = next_token_loss(model, batch)
    assert abs(float(loss) - np.log(vocab)) < 1.0
