"""`model.attention`: the kernel choice for every device, dtype and layout; its wiring."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import batch_of, make

import trainer.models.attention as attention
from trainer.errors import ConfigError
from trainer.models.attention import choose_attention


def choose(
    requested="auto", platform="gpu", cc="9.0", dtype=jnp.bfloat16, head_dim=64, packed=False
):
    return choose_attention(
        requested,
        platform=platform,
        compute_capability=cc,
        compute_dtype=dtype,
        head_dim=head_dim,
        packed=packed,
    )


@pytest.mark.parametrize(
    "facts, expected",
    [
        (dict(platform="cpu", cc=None), "xla"),
        (dict(platform="tpu", cc=None), "xla"),
        (dict(), "cudnn"),  # H100: cc 9.0, bf16
        (dict(cc="8.0", dtype=jnp.float16), "cudnn"),  # A100, fp16
        (dict(cc="7.5", dtype=jnp.float16), "xla"),  # RTX 2080 Ti
        (dict(dtype=jnp.float32), "xla"),
        (dict(cc="8.6", head_dim=192), "xla"),  # above cuDNN's 128 before Hopper
        (dict(head_dim=36), "xla"),  # not a multiple of 8
        (dict(platform="gpu", cc=None), "xla"),  # a GPU that is not CUDA
        (dict(packed=True), "xla"),  # packed rows need the document mask
    ],
)
def test_auto_picks_cudnn_only_where_it_runs(facts, expected):
    assert choose(**facts) == expected


@pytest.mark.parametrize(
    "facts", [dict(platform="cpu", cc=None), dict(), dict(packed=True), dict(dtype=jnp.float32)]
)
def test_forced_xla_is_xla_anywhere(facts):
    assert choose("xla", **facts) == "xla"


def test_forced_cudnn_runs_where_it_can_and_packed_rows_fall_back_to_xla():
    assert choose("cudnn") == "cudnn"
    assert choose("cudnn", packed=True) == "xla"


@pytest.mark.parametrize(
    "facts, named",
    [
        (dict(platform="cpu", cc=None), "this run has cpu;"),
        (dict(platform="tpu", cc=None), "this run has tpu;"),
        (dict(cc="7.5", dtype=jnp.float16), "compute capability 7.5"),
        (dict(dtype=jnp.float32), "float32 compute"),
        (dict(head_dim=36), "head dim 36"),
    ],
)
def test_forced_cudnn_where_it_cannot_run_is_one_line_naming_the_fix(facts, named):
    with pytest.raises(ConfigError) as error:
        choose("cudnn", **facts)
    message = str(error.value)
    assert "\n" not in message and named in message
    assert message.startswith("model.attention=cudnn needs")
    assert message.endswith("use model.attention=auto or xla")


def test_forced_cudnn_fails_at_model_build_on_cpu():
    with pytest.raises(ConfigError, match="this run has cpu"):
        make(["model.attention=cudnn"], "bfloat16")


def test_xla_gives_the_default_logits_on_cpu():
    """On CPU `auto` is XLA; rows without segment ids (causal, no mask) match all-ones ids."""
    tokens = np.arange(32).reshape(2, 16) % 64
    packed = batch_of(tokens, [[1] * 9 + [2] * 7, [1] * 16])
    auto, xla = make(), make(["model.attention=xla"])
    np.testing.assert_array_equal(auto(packed), xla(packed))
    one_doc = batch_of(tokens)
    no_ids = {k: v for k, v in one_doc.items() if k != "segment_ids"}
    np.testing.assert_allclose(xla(one_doc), xla(no_ids), atol=1e-6)


def test_on_a_cuda_gpu_unpacked_rows_take_cudnn_without_a_mask(monkeypatch):
    """What the model asks `jax.nn.dot_product_attention` for on an H100 (faked; the call is
    then run by XLA): cuDNN with `is_causal` and no [B,1,L,L] mask, unless rows are packed."""
    monkeypatch.setattr(attention, "device_facts", lambda: ("gpu", "9.0"))
    calls = []
    real = jax.nn.dot_product_attention

    def recorder(q, k, v, mask=None, *, is_causal, implementation):
        calls.append((implementation, mask is None, is_causal))
        return real(q, k, v, mask=mask, is_causal=is_causal, implementation="xla")

    monkeypatch.setattr(jax.nn, "dot_product_attention", recorder)
    model = make(compute="bfloat16")
    batch = batch_of(np.arange(16)[None] % 64)
    model({k: v for k, v in batch.items() if k != "segment_ids"})
    assert set(calls) == {("cudnn", True, True)}
    calls.clear()
    model(batch)
    assert set(calls) == {("xla", False, False)}
