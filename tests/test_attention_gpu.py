"""Every GPU attention kernel against XLA with the document mask: outputs and input gradients,
bf16 and fp16, grouped-query and plain multi-head, at bf16 tolerance; then the model and a short
training run with the kernel `auto` picks. Run with `python -m pytest -m gpu` on a GPU host (the
rest of the suite pins the CPU platform, tests/conftest.py); skipped anywhere else."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer.config import load_config
from trainer.models import kernels
from trainer.models.attention import attention_kernel, facts_here
from trainer.models.layers import PackedLayout, packed_causal_mask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        jax.default_backend() != "gpu",
        reason="needs an NVIDIA GPU and `-m gpu` (other runs pin the CPU)",
    ),
]


def capability() -> tuple[int, int]:
    major, minor = jax.devices()[0].compute_capability.split(".")
    return int(major), int(minor)


MAX_DOCS = 4  # per row, plus a padding run
LENGTH = 512


def segment_ids(B: int = 4, L: int = LENGTH) -> np.ndarray:
    """Rows as the packers make them: MAX_DOCS documents and no padding; documents of very
    different lengths (one of a single token) and padding; one document spanning the row."""
    rows = [
        np.repeat([1, 2, 3, 4], [100, 1, 300, 111]),
        np.repeat([1, 2, 3, 0], [37, 200, 211, 64]),
        np.ones(L, int),
        np.repeat([1, 2, 0], [256, 128, 128]),
    ]
    return np.stack(rows[:B]).astype(np.int32)


def qkv(heads: int, kv_heads: int, dtype, head_dim: int = 64, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (4, LENGTH, heads, head_dim)
    kv_shape = (4, LENGTH, kv_heads, head_dim)
    return [
        jax.random.normal(key, s, jnp.float32).astype(dtype)
        for key, s in zip(keys, (shape, kv_shape, kv_shape, shape), strict=True)
    ]


def outputs_and_grads(attention, q, k, v, cotangent):
    def loss(q, k, v):
        out = attention(q, k, v).astype(jnp.float32)
        return jnp.sum(out * cotangent.astype(jnp.float32)), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def assert_close_as_bf16(got, want, what):
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, atol=2e-2 * scale, rtol=2e-2, err_msg=f"{what}: {name}")


def xla_in_float32(ids):
    mask = packed_causal_mask(jnp.asarray(ids))

    def attention(q, k, v):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return jax.nn.dot_product_attention(*f32, mask=mask, implementation="xla")

    return attention


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("kernel", ["cudnn_packed", "pallas", "cudnn_mask", "xla_dropout"])
def test_kernel_matches_xla_with_the_mask(kernel, heads, dtype):
    if kernel == "cudnn_packed" and capability() < (9, 0):
        pytest.skip("cuDNN's packed layout needs compute capability 9.0")
    if kernel in ("cudnn_packed", "pallas"):
        assert kernels.works(kernel, dtype, 64, LENGTH), f"{kernel} failed its probe here"
    ids = segment_ids()
    layout = PackedLayout.of(
        jnp.asarray(ids),
        jnp.zeros(ids.shape, jnp.int32),
        64,
        10000.0,
        kernel=kernel,
        max_segments=MAX_DOCS + 1,
    )
    q, k, v, cotangent = qkv(*heads, dtype)
    got = outputs_and_grads(
        functools.partial(kernels.attend, kernel, layout=layout), q, k, v, cotangent
    )
    want = outputs_and_grads(xla_in_float32(ids), q, k, v, cotangent)
    assert_close_as_bf16(got, want, kernel)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_cudnn_on_rows_of_one_document_matches_xla(heads, dtype):
    ids = np.ones((4, LENGTH), np.int32)
    layout = PackedLayout.of(None, jnp.zeros(ids.shape, jnp.int32), 64, 10000.0)
    q, k, v, cotangent = qkv(*heads, dtype)
    got = outputs_and_grads(
        functools.partial(kernels.attend, "cudnn", layout=layout), q, k, v, cotangent
    )
    want = outputs_and_grads(xla_in_float32(ids), q, k, v, cotangent)
    assert_close_as_bf16(got, want, "cudnn")


def test_the_cudnn_packed_probe_finds_a_working_mode():
    """`native` where jax places grouped-query K/V heads right (0.11.2+), `repeat_kv` before."""
    if capability() < (9, 0):
        pytest.skip("cuDNN's packed layout needs compute capability 9.0")
    mode = kernels.probe("cudnn_packed", "bfloat16", 128, 0)
    print(f"jax {jax.__version__}: cudnn_packed probe says {mode}")
    assert mode in ("native", "repeat_kv")


SMALL = [
    "model.num_layers=2",
    "model.d_model=256",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.d_ff=512",
    f"data.seq_len={LENGTH}",
    "data.global_batch_size=4",
    f"data.max_docs_per_row={MAX_DOCS}",
    "optim.warmup_steps=5",
    "optim.lr=3e-3",
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
]
VOCAB = 256


def batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    ids = segment_ids()
    positions = np.zeros_like(ids)
    for b in range(ids.shape[0]):
        for i in range(1, ids.shape[1]):
            positions[b, i] = positions[b, i - 1] + 1 if ids[b, i] == ids[b, i - 1] else 0
    out = []
    for _ in range(n):
        tokens = rng.integers(0, VOCAB // 4, (ids.shape[0], ids.shape[1] + 1)).astype(np.int32)
        tokens[:, 1::2] = tokens[:, :-1:2]  # something to learn: every other token repeats
        out.append(
            {
                "inputs": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "segment_ids": ids,
                "positions": positions,
                "weights": (ids > 0).astype(np.float32),
            }
        )
    return out


def training_losses(overrides, steps: int = 30) -> list[float]:
    from trainer.models import builder_for_vocab
    from trainer.parallel import sharding
    from trainer.program import build_program

    config = load_config(None, [*SMALL, *overrides])
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    program = build_program(config, mesh, builder_for_vocab(config, VOCAB))
    state = program.init()
    losses = []
    with jax.set_mesh(program.mesh):
        for batch in batches(steps):
            state, metrics = program.train_step(
                state, jax.device_put(batch, program.batch_sharding)
            )
            losses.append(float(metrics["loss"]))
    return losses


def test_auto_picks_the_packed_kernel_for_this_gpu():
    from trainer.models import builder_for_vocab

    config = load_config(None, SMALL)
    model = builder_for_vocab(config, VOCAB)(rngs=nnx.Rngs(0))
    kernel = attention_kernel("auto", facts_here(model.spec, LENGTH, True, training=False))
    expected = "cudnn_packed" if capability() >= (9, 0) else "pallas"
    assert kernel == expected


def test_training_with_the_auto_kernel_follows_xla():
    """The acceptance check of issue 26 in small: the losses of a packed run with the kernel
    `auto` picks match XLA's to 1e-2 relative."""
    auto = training_losses([])
    xla = training_losses(["model.attention=xla"])
    np.testing.assert_allclose(auto, xla, rtol=1e-2)
    assert auto[-1] < auto[0]
