"""`model.attention`: the kernel choice for every device, dtype and batch; the document spans the
cuDNN packed kernel reads; each kernel's wiring on CPU (the GPU comparisons are in
test_attention_gpu.py); dropout where nanoGPT puts it; the run's attention line."""

import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as private_cudnn
from test_model import batch_of, make

import trainer.models.attention as attention
from input_pipeline.errors import DataError
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.models import kernels
from trainer.models.attention import AttentionFacts, choose_attention
from trainer.models.layers import packed_causal_mask

GUARDED = {"cudnn_packed", "pallas"}


def facts(**changes) -> AttentionFacts:
    """An H100 (cc 9.0) training bf16 on packed rows of 2048 with the packers' bound, changed."""
    base = dict(
        platform="gpu",
        compute_capability="9.0",
        compute_dtype=jnp.bfloat16,
        head_dim=128,
        seq_len=2048,
        packed=True,
        max_docs_per_row=16,
    )
    return AttentionFacts(**{**base, **changes})


def choose(requested="auto", failing=(), **changes):
    """The choice where the guarded kernels named in `failing` fail their probe."""
    return choose_attention(requested, facts(**changes), lambda kernel: kernel not in failing)


# ----------------------------------------------------------------------------- the choice


@pytest.mark.parametrize(
    "changes, failing, expected",
    [
        (dict(), (), "cudnn_packed"),  # H100/H200 bf16, packed rows
        (dict(compute_dtype=jnp.float16), (), "cudnn_packed"),
        (dict(compute_capability="10.0"), (), "cudnn_packed"),  # Blackwell
        (dict(), ("cudnn_packed",), "pallas"),  # private API moved, or wrong numbers
        (dict(max_docs_per_row=None), (), "pallas"),  # rows of unknown document count
        (dict(), GUARDED, "cudnn_mask"),
        (dict(seq_len=2047), GUARDED, "xla"),  # cuDNN's bias backward needs even lengths
        (dict(compute_capability="8.0"), (), "pallas"),  # A100: no packed layout before Hopper
        (dict(compute_capability="8.6"), ("pallas",), "cudnn_mask"),
        (dict(compute_capability="8.9", head_dim=96), (), "cudnn_mask"),  # Pallas: powers of 2
        (dict(compute_capability="8.9", seq_len=2056), (), "cudnn_mask"),  # no Pallas block fits
        (dict(compute_capability="7.5", compute_dtype=jnp.float16), (), "xla"),  # T4
        # bf16 before Ampere: jax's XLA attention asks for a bf16 dot algorithm XLA refuses there
        (dict(compute_capability="7.5"), (), "xla_written"),
        (dict(compute_capability="7.0", packed=False), (), "xla_written"),  # V100
        (dict(compute_capability="7.5", compute_dtype=jnp.float32), (), "xla"),
        (dict(compute_dtype=jnp.float32), (), "xla"),
        (dict(head_dim=36), (), "xla"),  # not a multiple of 8
        (dict(compute_capability="8.6", head_dim=192), (), "xla"),  # over 128 before Hopper
        (dict(compute_capability=None), (), "xla"),  # a GPU that is not CUDA
        (dict(platform="cpu", compute_capability=None), (), "xla"),
        (dict(platform="tpu", compute_capability=None), (), "xla"),
        (dict(pipelined=True), (), "xla"),  # the spans cannot go through the stage vmap
        (dict(packed=False), (), "cudnn"),  # one document per row: causal, no mask
        (dict(packed=False, pipelined=True), (), "cudnn"),
        (dict(packed=False, compute_capability="8.0"), (), "cudnn"),
        (dict(packed=False, platform="cpu", compute_capability=None), (), "xla"),
    ],
)
def test_auto_picks_the_fastest_kernel_that_runs_correctly_here(changes, failing, expected):
    assert choose(failing=failing, **changes) == expected


CUDNN_RUNS = [dict(), dict(packed=False), dict(compute_capability="8.0")]
CUDNN_CANNOT = [dict(platform="cpu", compute_capability=None), dict(compute_dtype=jnp.float32)]


@pytest.mark.parametrize(
    "requested, changes",
    [(r, c) for r in ("auto", "xla", "cudnn") for c in CUDNN_RUNS]
    + [(r, c) for r in ("auto", "xla") for c in CUDNN_CANNOT],
)
def test_training_with_dropout_drops_probabilities_in_xla_on_every_device(requested, changes):
    """cuDNN's private API takes one static integer seed (the same mask every step) and
    jax.nn's none: while dropout > 0 only the written-out XLA kernel drops probabilities."""
    assert choose(requested, dropout=0.1, **changes) == "xla_dropout"


@pytest.mark.parametrize("changes", [dict(), dict(packed=False), dict(platform="cpu")])
def test_forced_xla_is_xla_anywhere(changes):
    assert choose("xla", **changes) == "xla"


def test_forced_xla_is_written_out_for_bf16_before_ampere():
    assert choose("xla", compute_capability="7.5") == "xla_written"


@pytest.mark.parametrize(
    "changes, failing, expected",
    [
        (dict(), (), "cudnn_packed"),
        (dict(), ("cudnn_packed",), "cudnn_mask"),  # never Pallas when cuDNN is asked for
        (dict(compute_capability="8.0"), (), "cudnn_mask"),
        (dict(packed=False), (), "cudnn"),
        (dict(pipelined=True), (), "xla"),
    ],
)
def test_forced_cudnn_runs_a_cudnn_kernel_where_one_fits(changes, failing, expected):
    assert choose("cudnn", failing=failing, **changes) == expected


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(platform="cpu", compute_capability=None), "this run has cpu;"),
        (dict(platform="tpu", compute_capability=None), "this run has tpu;"),
        (dict(compute_capability="7.5", compute_dtype=jnp.float16), "compute capability 7.5"),
        (dict(compute_dtype=jnp.float32), "float32 compute"),
        (dict(head_dim=36), "head dim 36"),
    ],
)
def test_forced_cudnn_where_it_cannot_run_is_one_line_naming_the_fix(changes, named):
    with pytest.raises(ConfigError) as error:
        choose("cudnn", **changes)
    message = str(error.value)
    assert "\n" not in message and named in message
    assert message.startswith("model.attention=cudnn needs")
    assert message.endswith("use model.attention=auto or xla")


def test_forced_cudnn_fails_at_model_build_on_cpu():
    with pytest.raises(ConfigError, match="this run has cpu"):
        make(["model.attention=cudnn"], "bfloat16")


def test_no_kernel_is_probed_where_only_public_ones_can_run():
    """Probes compile on the device: never off an NVIDIA GPU, nor for rows of one document."""

    def no_probe(kernel):
        raise AssertionError(f"probed {kernel}")

    for changes in (dict(platform="cpu", compute_capability=None), dict(packed=False)):
        choose_attention("auto", facts(**changes), no_probe)


# ----------------------------------------------------------------------------- document spans


def spans_reference(segment_ids: np.ndarray, max_segments: int):
    """Runs of equal ids (padding runs included), row by row in Python."""
    B = segment_ids.shape[0]
    lengths = np.full((B, max_segments), -1)
    starts = np.full((B, max_segments + 1), -1)
    overflow = np.zeros(B, bool)
    for b, row in enumerate(segment_ids):
        runs = []
        for t, value in enumerate(row):
            if t == 0 or value != row[t - 1]:
                runs.append([t, 0])
            runs[-1][1] += 1
        overflow[b] = len(runs) > max_segments
        for m, (start, length) in enumerate(runs[:max_segments]):
            starts[b, m], lengths[b, m] = start, length
    return lengths, starts, overflow


M = 4  # slots per row: 3 documents and a padding run
ROWS = {
    "documents and trailing padding": [1] * 5 + [2] * 3 + [3] * 4 + [0] * 4,
    "exactly M documents, no padding": [1] * 2 + [2] * 6 + [3] * 4 + [4] * 4,
    "M-1 documents and padding": [1] * 7 + [2] * 1 + [3] * 2 + [0] * 6,
    "one document spanning the row": [1] * 16,
    "one token documents": [1, 2, 3, 0] + [0] * 12,
    "concat packing: ids restart at 1": [1] * 9 + [2] * 7,
    "padding only": [0] * 16,
    "more than M documents": [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 0, 0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("name", ROWS)
def test_document_spans_match_a_python_reference(name):
    ids = np.array([ROWS[name], ROWS["documents and trailing padding"]], np.int32)
    got = jax.jit(kernels.document_spans, static_argnums=1)(jnp.asarray(ids), M)
    want = spans_reference(ids, M)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert got.lengths.dtype == got.starts.dtype == jnp.int32
    assert got.starts.shape == (2, M + 1)


def cudnn_mask_of(spans, length):
    """What cuDNN's PADDING_CAUSAL packed layout computes with `spans` (per jax's docstring):
    token i sees token j <= i of its own document; a token in no document is never written."""
    lengths, starts = np.asarray(spans.lengths), np.asarray(spans.starts)[:, :-1]
    t = np.arange(length)
    inside_BxMxL = (starts[..., None] <= t) & (t < starts[..., None] + lengths[..., None])
    inside_BxMxL &= lengths[..., None] >= 0
    same_BxLxL = np.einsum("bmi,bmj->bij", inside_BxMxL, inside_BxMxL) > 0
    return same_BxLxL & (t[None, :, None] >= t[None, None, :]), inside_BxMxL.any(axis=1)


@pytest.mark.parametrize("name", [n for n in ROWS if n != "more than M documents"])
def test_cudnn_sees_the_xla_mask_and_writes_every_token(name):
    ids = jnp.asarray([ROWS[name]], jnp.int32)
    spans = kernels.document_spans(ids, M)
    mask, written = cudnn_mask_of(spans, ids.shape[1])
    assert written.all()
    np.testing.assert_array_equal(mask, np.asarray(packed_causal_mask(ids))[:, 0])


def test_a_row_over_the_bound_is_flagged_not_merged():
    spans = kernels.document_spans(jnp.asarray([ROWS["more than M documents"]]), M)
    assert bool(spans.overflow[0])
    _, written = cudnn_mask_of(spans, 16)
    assert not written.all()  # cuDNN would leave these tokens: the kernel makes the row NaN


@pytest.mark.parametrize(
    "kernel, built",
    [("xla", "mask"), ("cudnn_mask", "mask"), ("pallas", "segment_ids"), ("cudnn_packed", "spans")],
)
def test_the_layout_holds_what_the_kernel_reads_split_with_the_batch(kernel, built):
    """Built once per forward pass, only for the chosen kernel; on a mesh the document spans
    split over the batch axes as the rows do (cuDNN's partitioner runs each device's rows)."""
    from trainer.models.layers import PackedLayout
    from trainer.parallel.sharding import BATCH_AXES, make_mesh

    config = load_config(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    ids = jnp.asarray([ROWS[name] for name in list(ROWS)[:4]], jnp.int32)

    def layout_of(ids):
        return PackedLayout.of(ids, jnp.zeros_like(ids), 16, 1e4, kernel=kernel, max_segments=M)

    mesh = make_mesh(config.mesh, jax.devices()[:8])
    with jax.set_mesh(mesh):
        layout = jax.jit(layout_of)(ids)
    fields = {"mask", "segment_ids", "spans"}
    assert {f for f in fields if getattr(layout, f) is not None} == {built}
    for x in layout.spans or ():
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(BATCH_AXES))
        assert x.sharding.is_equivalent_to(rows, x.ndim)


def test_host_check_of_a_callers_rows_names_the_bound_and_the_fix():
    ok = np.array([ROWS["documents and trailing padding"], ROWS["exactly M documents, no padding"]])
    attention.check_documents_per_row(ok, max_docs_per_row=M - 1)
    with pytest.raises(DataError) as error:
        attention.check_documents_per_row(np.array([ROWS["more than M documents"]]), M - 1)
    message = str(error.value)
    assert "\n" not in message and "holds 6 runs" in message
    assert "data.max_docs_per_row=3" in message and "data.max_docs_per_row to 5" in message
    rows = [{"segment_ids": ok}, {"inputs": ok}, {"segment_ids": np.ones((2, 16), np.int32)}]
    passed = list(attention.CheckedBatches(rows, M - 1))
    assert len(passed) == 3 and all(a is b for a, b in zip(passed, rows, strict=True))
    too_many = [{"segment_ids": np.array([ROWS["more than M documents"]])}]
    with pytest.raises(DataError, match="holds 6 runs"):
        list(attention.CheckedBatches(too_many, M - 1))


def test_checked_batches_keep_the_iterators_state_for_checkpoints():
    """A caller's Grain iterator is checkpointed through the check's wrapper."""
    import grain

    rows = [{"segment_ids": np.ones((2, 16), np.int32) * i} for i in range(1, 5)]
    checked = attention.CheckedBatches(iter(grain.MapDataset.source(rows).to_iter_dataset()), 3)
    next(checked)
    state = checked.get_state()
    second = next(checked)
    checked.set_state(state)
    assert np.array_equal(next(checked)["segment_ids"], second["segment_ids"])


# ----------------------------------------------------------------------------- kernels on CPU


def qkv(B=2, L=64, H=4, G=2, K=16, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = [(B, L, H, K), (B, L, G, K), (B, L, G, K)]
    return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True)]


def packed_ids(B=2, L=64):
    """Rows of 3 and 2 documents, then padding."""
    rows = [[1] * 20 + [2] * 20 + [3] * 14 + [0] * 10, [1] * 40 + [2] * 24]
    return jnp.asarray(rows[:B], jnp.int32)[:, :L]


def xla_reference(q, k, v, segment_ids):
    return jax.nn.dot_product_attention(q, k, v, mask=packed_causal_mask(segment_ids))


def outputs_and_grads(attend, q, k, v):
    cotangent = jax.random.normal(jax.random.key(9), q.shape, q.dtype)

    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out * cotangent), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def assert_same_attention(attend, q, k, v, segment_ids, atol=1e-5):
    got = outputs_and_grads(attend, q, k, v)
    want = outputs_and_grads(functools.partial(xla_reference, segment_ids=segment_ids), q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=atol, rtol=atol)


def test_dropout_attention_at_rate_zero_is_xla_attention():
    q, k, v = qkv()
    ids = packed_ids()
    mask = packed_causal_mask(ids)
    attend = functools.partial(kernels.dropout_attention, mask=mask, rate=0.0, key=None)
    assert_same_attention(attend, q, k, v, ids)
    causal = kernels.dropout_attention(q, k, v, None, 0.0, None)
    np.testing.assert_allclose(
        causal, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=1e-5
    )


def test_the_decoder_writes_attention_out_where_bf16_dots_are_refused(monkeypatch):
    """On a GPU before Ampere the decoder's bf16 attention is written out, as training's is:
    jax's asked for a dot algorithm XLA refuses there (a prompt of several tokens did not
    compile for an RTX 2080 Ti). Here on CPU, under that GPU's facts: the same logits."""
    from trainer.models.decode import KVCache, decode

    model = make(compute="bfloat16")
    tokens = jnp.asarray([[1, 5, 9, 2, 7], [3, 3, 8, 1, 4]], jnp.int32)
    cache = KVCache.empty(model, 2, 12)
    want, _ = decode(model, tokens, jnp.int32(0), cache)

    def refused(*args, **kwargs):
        raise AssertionError("jax's XLA attention asks for ALG_DOT_BF16_BF16_F32")

    monkeypatch.setattr(jax.nn, "dot_product_attention", refused)
    with kernels.planned_device("gpu", "7.5"):
        got, _ = decode(model, tokens, jnp.int32(0), cache)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


def test_dropout_attention_drops_probabilities_with_a_fresh_mask_per_key():
    """Probabilities are dropped and rescaled: one value per key row survives or not, and the
    expectation over masks is the undropped attention."""
    q, k, v = qkv(B=1, L=16, H=2, G=2)
    mask = packed_causal_mask(jnp.ones((1, 16), jnp.int32))
    plain = kernels.dropout_attention(q, k, v, mask, 0.0, None)
    drop = jax.jit(lambda key: kernels.dropout_attention(q, k, v, mask, 0.5, key))
    first, second = drop(jax.random.key(1)), drop(jax.random.key(2))
    assert not np.allclose(first, second) and not np.allclose(first, plain)
    np.testing.assert_array_equal(first, drop(jax.random.key(1)))
    mean = jnp.mean(jax.vmap(drop)(jax.random.split(jax.random.key(3), 1000)), axis=0)
    np.testing.assert_allclose(mean, plain, atol=0.2)  # 1000 masks: std of the mean <= 0.04


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_pallas_with_segment_ids_matches_xla_in_the_interpreter(heads):
    """The Pallas kernel's wiring (K/V repeat, segment ids, causal, scale, blocks) run by
    Pallas' interpreter on CPU: same output and input gradients as XLA with the mask."""
    q, k, v = qkv(H=heads[0], G=heads[1])
    ids = packed_ids()
    attend = functools.partial(kernels.pallas_attention, segment_ids_BxL=ids)
    assert_same_attention(attend, q, k, v, ids)


def test_pallas_runs_per_shard_on_a_mesh():
    """Rows over (data, fsdp) and heads over tensor, as the batch and the weights are split."""
    config = load_config(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    from trainer.parallel.sharding import make_mesh

    mesh = make_mesh(config.mesh, jax.devices()[:8])
    q, k, v = qkv(B=4, L=32, H=4, G=2)
    ids = jnp.concatenate([packed_ids(L=32)] * 2)
    with jax.set_mesh(mesh):
        got = jax.jit(kernels.pallas_attention)(q, k, v, ids)
    np.testing.assert_allclose(got, xla_reference(q, k, v, ids), atol=1e-5)


def fake_private_cudnn(misplace_grouped_kv=False):
    """jax's private cuDNN entry point as its docstring describes it, computed by XLA: each
    document slot attends causally within itself; tokens in no slot are never written (777).
    `misplace_grouped_kv`: wrong numbers with fewer K/V heads than query heads, like jax
    0.10.2-0.11.0 before PR #39521."""
    calls = []

    def dot_product_attention(
        query, key, value, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type
    ):
        B, L, H, _ = query.shape
        M = q_seqlen.shape[1]
        assert mask_type == private_cudnn.MaskType.PADDING_CAUSAL
        assert q_seqlen.shape == (B, M) and q_offsets.shape == (B, M + 1)
        assert {x.dtype for x in (q_seqlen, kv_seqlen, q_offsets, kv_offsets)} == {
            jnp.dtype(jnp.int32)
        }
        calls.append((M, H, key.shape[2]))
        t = jnp.arange(L)
        starts = q_offsets[:, :M, None]
        inside = (starts <= t) & (t < starts + q_seqlen[..., None]) & (q_seqlen[..., None] >= 0)
        same = jnp.einsum("bmi,bmj->bij", inside.astype(jnp.int32), inside.astype(jnp.int32))
        mask = (same > 0) & jnp.tril(jnp.ones((L, L), bool))
        out = jax.nn.dot_product_attention(query, key, value, mask=mask[:, None], scale=scale)
        out = jnp.where(inside.any(axis=1)[..., None, None], out, 777.0).astype(query.dtype)
        return out + 1.0 if misplace_grouped_kv and key.shape[2] < H else out

    return dot_product_attention, calls


@pytest.fixture
def fresh_probes():
    probe = kernels.probe  # the cached one, whatever a test puts in its place
    probe.cache_clear()
    yield
    probe.cache_clear()


def test_cudnn_packed_wiring_matches_xla_with_the_mask(monkeypatch):
    fake, calls = fake_private_cudnn()
    monkeypatch.setattr(private_cudnn, "dot_product_attention", fake)
    q, k, v = qkv()
    ids = packed_ids()
    spans = kernels.document_spans(ids, M)
    attend = functools.partial(kernels.cudnn_packed_attention, spans=spans)
    assert_same_attention(attend, q, k, v, ids)
    assert calls[0] == (M, 4, 2)  # grouped-query heads passed as they are
    repeated = functools.partial(kernels.cudnn_packed_attention, spans=spans, repeat_kv=True)
    assert_same_attention(repeated, q, k, v, ids)
    assert calls[-1] == (M, 4, 4)


def test_cudnn_packed_makes_a_row_over_the_bound_nan(monkeypatch):
    monkeypatch.setattr(private_cudnn, "dot_product_attention", fake_private_cudnn()[0])
    q, k, v = qkv(B=2, L=16)
    ids = jnp.asarray([ROWS["more than M documents"], ROWS["one document spanning the row"]])
    out = kernels.cudnn_packed_attention(q, k, v, kernels.document_spans(ids, M))
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize(
    "misplace, expected", [(False, "native"), (True, "repeat_kv")], ids=["fixed", "jax<0.11.2"]
)
def test_probe_detects_misplaced_grouped_query_heads_by_numbers(
    monkeypatch, fresh_probes, capsys, misplace, expected
):
    """The probe compares with XLA on a tiny packed batch: never a version string."""
    monkeypatch.setattr(private_cudnn, "dot_product_attention", fake_private_cudnn(misplace)[0])
    assert kernels.probe("cudnn_packed", "bfloat16", 32, 0) == expected
    assert kernels.probe("cudnn_packed", "bfloat16", 32, 0) == expected  # found once
    said = capsys.readouterr().err.splitlines()
    assert len(said) == (1 if misplace else 0)
    assert not misplace or "repeating K/V heads" in said[0]


def broken(query, key, value, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type):
    raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED\nlong detail")


def wrong(query, key, value, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type):
    return jnp.zeros_like(query)


def moved(query, key, value, bias=None, mask=None, *, scale=1.0, mask_type=None):
    raise AssertionError("never called: its signature lacks the offsets")


@pytest.mark.parametrize(
    "replacement, said",
    [
        (broken, "failed its self-test (RuntimeError: CUDNN_STATUS_NOT_SUPPORTED)"),
        (wrong, "gave wrong numbers in its self-test against XLA"),
        (
            moved,
            "jax._src.cudnn.fused_attention_stablehlo.dot_product_attention has no kv_offsets, "
            "kv_seqlen, q_offsets, q_seqlen",
        ),
    ],
)
def test_a_failing_private_kernel_falls_back_with_one_line(
    monkeypatch, fresh_probes, capsys, replacement, said
):
    monkeypatch.setattr(private_cudnn, "dot_product_attention", replacement)
    assert not kernels.works("cudnn_packed", jnp.bfloat16, 32, 256)
    assert not kernels.works("cudnn_packed", jnp.bfloat16, 32, 256)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"warning: attention: cudnn_packed unavailable here ({said}); using the next kernel"
    ]
    real = kernels.probe  # Pallas failing too (its interpreter is slow): cuDNN with a mask
    monkeypatch.setattr(
        kernels, "probe", lambda kernel, *a: None if kernel == "pallas" else real(kernel, *a)
    )
    assert attention.attention_kernel("auto", facts(head_dim=32, seq_len=256)) == "cudnn_mask"


def test_a_plan_for_a_gpu_that_is_not_here_probes_nothing(monkeypatch):
    """`trainer.plan --gpu` traces for a GPU it does not have: the kernel that GPU would run."""

    def no_probe(*args):
        raise AssertionError("probed")

    monkeypatch.setattr(kernels, "probe", no_probe)
    with kernels.planned_device("gpu", "9.0"):
        assert attention.device_facts() == ("gpu", "9.0")
        assert attention.attention_kernel("auto", facts()) == "cudnn_packed"
        assert attention.attention_kernel("auto", facts(compute_capability="8.0")) == "pallas"


def test_pallas_probe_passes_in_the_interpreter(fresh_probes):
    assert kernels.works("pallas", jnp.float32, 16, 16)


def test_pallas_runs_with_deprecation_warnings_as_errors():
    """jax 0.12 deprecates its Pallas attention module with a warning at import (for another
    package): before, under `-W error::DeprecationWarning` the probe ended in that warning's
    traceback. jax 0.10.2 gives no such warning: there this passes either way. In a fresh
    process, where the module is not imported yet; the warning filters are left as they were."""
    code = (
        "import warnings; from trainer.models import kernels; before = list(warnings.filters); "
        "assert kernels.works('pallas', 'float32', 16, 16); "
        "assert warnings.filters == before, 'filters changed'; print('ran')"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr[-2000:]


# ----------------------------------------------------------------------------- the model


def on_a_gpu(monkeypatch, capability):
    """The model believes it runs on a CUDA GPU; jax.nn's cuDNN calls run XLA on this CPU."""
    monkeypatch.setattr(attention, "device_facts", lambda: ("gpu", capability))
    real = jax.nn.dot_product_attention

    def on_cpu(*args, implementation=None, **kwargs):
        assert implementation in (None, "xla", "cudnn")
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", on_cpu)


def test_on_hopper_packed_rows_run_cudnn_packed_with_the_bound_plus_padding(
    monkeypatch, fresh_probes
):
    fake, calls = fake_private_cudnn()
    monkeypatch.setattr(private_cudnn, "dot_product_attention", fake)
    on_a_gpu(monkeypatch, "9.0")
    tokens = np.arange(64).reshape(2, 32) % 64
    batch = batch_of(tokens, [[1] * 9 + [2] * 7 + [3] * 10 + [0] * 6, [1] * 32])
    model = build(compute="bfloat16", max_docs_per_row=3)
    reference = build(["model.attention=xla"], compute="bfloat16", max_docs_per_row=3)
    np.testing.assert_allclose(model(batch), reference(batch), atol=2e-2)
    assert {c[0] for c in calls} == {4}  # 3 documents and a padding run per row


def test_on_ampere_packed_rows_run_pallas(monkeypatch):
    """Pallas in its interpreter, for a model of head dim 16 with grouped-query heads."""
    on_a_gpu(monkeypatch, "8.0")
    monkeypatch.setattr(kernels, "probe", lambda *a: "native")  # its own test is above
    seen = record_kernels(monkeypatch)
    tokens = np.arange(64).reshape(2, 32) % 64
    batch = batch_of(tokens, [[1] * 9 + [2] * 23, [1] * 32])
    heads = ["model.num_heads=2", "model.num_kv_heads=1"]
    want = build([*heads, "model.attention=xla"], "bfloat16")(batch)
    seen.clear()
    np.testing.assert_allclose(build(heads, "bfloat16")(batch), want, atol=6e-2)  # bf16
    assert set(seen) == {"pallas"}


def build(overrides=(), compute="float32", max_docs_per_row=None, vocab=64):
    """`test_model.make`, with the bound on documents per row the trainer passes."""
    return make(overrides, compute, vocab, max_docs_per_row)


def test_xla_gives_the_default_logits_on_cpu():
    """On CPU `auto` is XLA; rows without segment ids (causal, no mask) match all-ones ids."""
    tokens = np.arange(32).reshape(2, 16) % 64
    packed = batch_of(tokens, [[1] * 9 + [2] * 7, [1] * 16])
    auto, xla = make(), make(["model.attention=xla"])
    np.testing.assert_array_equal(auto(packed), xla(packed))
    one_doc = batch_of(tokens)
    no_ids = {k: v for k, v in one_doc.items() if k != "segment_ids"}
    np.testing.assert_allclose(xla(one_doc), xla(no_ids), atol=1e-6)


def record_kernels(monkeypatch) -> list[str]:
    seen = []
    real = kernels.attend
    monkeypatch.setattr(
        "trainer.models.layers.attend", lambda kernel, *a: seen.append(kernel) or real(kernel, *a)
    )
    return seen


def test_dropout_drops_where_nanogpt_does_and_only_in_training(monkeypatch):
    """Training drops the embedding output, the attention probabilities and both residual
    branches; `model.eval()` (the eval step) drops nothing and runs the fast kernel."""
    on_a_gpu(monkeypatch, "9.0")
    dropped = []
    real = kernels.dropout

    def recording(x, rate, key):
        if key is not None:
            dropped.append(x.shape)
        return real(x, rate, key)

    monkeypatch.setattr("trainer.models.transformer.dropout", recording)
    monkeypatch.setattr(kernels, "dropout", recording)
    seen = record_kernels(monkeypatch)
    model = make(["model.dropout=0.2", "model.num_heads=4", "model.num_kv_heads=2"], "bfloat16")
    batch = batch_of(np.arange(32).reshape(2, 16) % 64)
    model({k: v for k, v in batch.items() if k != "segment_ids"})
    B, L, D = 2, 16, 32
    assert dropped == [(B, L, D), (B, 2, 2, L, L), (B, L, D), (B, L, D)]  # scan: one layer traced
    assert set(seen) == {"xla_dropout"}
    dropped.clear(), seen.clear()
    model.eval()
    model({k: v for k, v in batch.items() if k != "segment_ids"})
    assert dropped == [] and set(seen) == {"cudnn"}


def test_eval_step_drops_nothing():
    """The eval loss of a model trained with dropout is that of the same weights without it
    (it was computed with dropout before)."""
    from test_step import program_for, random_batches

    batch = random_batches(1)[0]
    losses = []
    for rate in ("0.0", "0.5"):
        program = program_for((1, 1, 1), ["precision.compute=float32", f"model.dropout={rate}"])
        state = program.init()
        with jax.set_mesh(program.mesh):
            metrics = program.eval_step(state, jax.device_put(batch, program.batch_sharding))
        losses.append(float(metrics["loss_sum"]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


# ----------------------------------------------------------------------------- the run's line


def run_config(*overrides):
    return load_config(None, ["data.seq_len=256", *overrides])


def test_the_runs_first_line_names_the_kernel_on_cpu():
    note = attention.run_attention_note(run_config("precision.compute=float32"))
    assert note == "; attention xla (packed rows, cpu, float32)"
    dropping = run_config("model.dropout=0.2")
    assert attention.run_attention_note(dropping) == (
        "; attention xla (packed rows, cpu, bfloat16), xla_dropout while training "
        "(model.dropout=0.2)"
    )


def test_the_runs_first_line_names_the_kernel_that_passed_its_probe(monkeypatch):
    on_a_gpu(monkeypatch, "9.0")
    monkeypatch.setattr(
        kernels, "probe", lambda kernel, *a: None if kernel == "cudnn_packed" else "native"
    )
    note = attention.run_attention_note(run_config())
    assert note == "; attention pallas (packed rows, gpu cc 9.0, bfloat16)"
