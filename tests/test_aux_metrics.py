"""A loss function's aux scalars besides `weight` are metrics: each step's is weighted by `weight`
over the microbatches like the loss (so `optim.accum_steps=2` logs what one full batch does), a
metrics line averages its steps' finite values, and eval logs `eval_<name>` weighted over the eval
batches (per source and weight-mixed for a mixture). A bad aux is one line at the first trace."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, documents
from flax import nnx

import trainer
from input_pipeline.prepare import prepare_dataset
from trainer.step import ROW_METRIC_PREFIXES, ROW_METRICS, next_token_loss

FEATURES, CLASSES, ROWS = 4, 3, 16
AUX = ("nll", "label_mean", "odd_batch_id", "batch_id", "always")


class Linear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab"))
        self.out = nnx.Linear(FEATURES, CLASSES, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


def weighted_loss(model, batch):
    """Rows weighted by `w` (odd rows weigh more: accum_steps=2's two microbatches differ)."""
    logits = model(batch["x"]).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], -1)[:, 0]
    weight = jnp.sum(batch["w"])
    loss = jnp.sum(nll * batch["w"]) / weight
    batch_id = batch["id"][0]
    return loss, {
        "weight": weight,
        "nll": loss,  # logs as the loss does
        "label_mean": jnp.sum(batch["y"] * batch["w"]) / weight,  # data only: known by hand
        "odd_batch_id": jnp.where(batch_id % 2 == 1, batch_id, jnp.nan),  # NaN on even ids
        "batch_id": batch_id,  # int32
        "always": jnp.bool_(True),
    }


def make_batch(batch_id: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch_id)
    return {
        "x": rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
        "y": rng.integers(0, CLASSES, ROWS).astype(np.int32),
        "w": np.where(np.arange(ROWS) % 2, 3.0, 1.0)
        * rng.uniform(0.5, 1.5, ROWS).astype(np.float32),
        "id": np.full(ROWS, batch_id, np.int32),
    }


def label_mean(batches) -> float:
    """The weight-averaged label over `batches`, in float64."""
    ys = np.concatenate([b["y"] for b in batches]).astype(np.float64)
    ws = np.concatenate([b["w"] for b in batches]).astype(np.float64)
    return float((ys * ws).sum() / ws.sum())


TRAIN = [make_batch(0), make_batch(1)]
EVAL = [make_batch(10), make_batch(11)]


def config_for(workdir, *overrides):
    return trainer.load_config(
        None,
        [
            f"run.workdir={workdir}",
            "run.steps=2",
            "eval.every=2",
            "eval.steps=2",
            "checkpoint.every=100",
            "log.tensorboard=false",
            "log.progress=false",
            *overrides,
        ],
    )


def rows_of(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def train(workdir, *overrides, loss_fn=weighted_loss):
    config = config_for(workdir, *overrides)
    result = trainer.run(config, model=Linear, loss_fn=loss_fn, data=TRAIN, eval_data=EVAL)
    return result, rows_of(workdir)


@pytest.fixture(scope="module")
def one_line_per_step(tmp_path_factory):
    return train(tmp_path_factory.mktemp("per_step"), "log.every=1")


def test_aux_scalars_are_logged_like_the_loss(one_line_per_step):
    result, rows = one_line_per_step
    steps = {r["step"]: r for r in rows if "loss" in r}
    for step, batch in zip((1, 2), TRAIN, strict=True):
        row = steps[step]
        assert row["nll"] == pytest.approx(row["loss"], rel=1e-6)
        assert row["label_mean"] == pytest.approx(label_mean([batch]), rel=1e-6)
        assert row["batch_id"] == step - 1 and row["always"] == 1.0
    assert steps[1]["odd_batch_id"] == "nan" and steps[2]["odd_batch_id"] == 1.0
    assert {name: result.last_metrics[name] for name in AUX} == {
        name: steps[2][name] for name in AUX
    }


def test_eval_aux_is_weighted_over_the_eval_batches(one_line_per_step):
    _, rows = one_line_per_step
    (row,) = [r for r in rows if "eval_loss" in r]
    assert row["eval_nll"] == pytest.approx(row["eval_loss"], rel=1e-6)
    assert row["eval_label_mean"] == pytest.approx(label_mean(EVAL), rel=1e-6)
    weights = [b["w"].astype(np.float64).sum() for b in EVAL]
    assert row["eval_batch_id"] == pytest.approx((10 * weights[0] + 11 * weights[1]) / sum(weights))
    assert row["eval_always"] == 1.0


def test_accumulation_float16_and_offload_log_what_one_full_batch_does(one_line_per_step, tmp_path):
    """Microbatches of unequal weight: a plain mean of their means would be another number."""
    _, rows = train(
        tmp_path,
        "log.every=1",
        "optim.accum_steps=2",
        "precision.compute=float16",
        "optim.offload=true",
    )
    full = {r["step"]: r for r in one_line_per_step[1] if "loss" in r}
    accumulated = {r["step"]: r for r in rows if "loss" in r}
    for step, batch in zip((1, 2), TRAIN, strict=True):
        plain = np.mean([label_mean([{k: v[i::2] for k, v in batch.items()}]) for i in (0, 1)])
        assert plain != pytest.approx(label_mean([batch]), rel=1e-3)  # the test can tell
        assert accumulated[step]["label_mean"] == pytest.approx(full[step]["label_mean"], rel=1e-6)
        assert accumulated[step]["nll"] == pytest.approx(accumulated[step]["loss"], rel=1e-6)
        assert accumulated[step]["batch_id"] == pytest.approx(step - 1, rel=1e-6)
    assert accumulated[1]["nll"] == pytest.approx(full[1]["nll"], rel=1e-5)  # unscaled


def test_a_line_averages_its_steps_finite_values(one_line_per_step, tmp_path):
    _, rows = train(tmp_path, "log.every=2")
    (row,) = [r for r in rows if "loss" in r]
    assert row["label_mean"] == pytest.approx(np.mean([label_mean([b]) for b in TRAIN]), rel=1e-6)
    assert row["batch_id"] == 0.5
    assert row["odd_batch_id"] == 1.0  # step 1's NaN is left out, as a NaN loss is


def test_every_name_a_row_has_is_refused_as_an_aux_name(one_line_per_step):
    _, rows = one_line_per_step
    names = {key for row in rows for key in row} - set(AUX)
    assert names - {"step"}
    for name in names:
        assert name in ROW_METRICS or name.startswith(ROW_METRIC_PREFIXES), name


def with_aux(extra):
    def loss_fn(model, batch):
        loss, aux = weighted_loss(model, batch)
        return loss, {"weight": aux["weight"], **extra(batch)}

    return loss_fn


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            lambda batch: {"per_row": batch["w"]},
            r"^loss_fn's aux\['per_row'\] is float32 of shape \(16,\); return one real number "
            r"per aux name \(e\.g\. x\.mean\(\)\): each is logged as a metric",
        ),
        (
            lambda batch: {"note": "hello"},
            r"^loss_fn's aux\['note'\] is a str; return one real number",
        ),
        (
            lambda batch: {"phase": jnp.complex64(1j)},
            r"^loss_fn's aux\['phase'\] is complex64 of shape \(\); return one real number",
        ),
        (
            lambda batch: {"lr": jnp.float32(1)},
            r"^loss_fn's aux\['lr'\] has a name the trainer's own metrics use \('lr'\); rename it "
            r"in loss_fn's aux \(e\.g\. 'aux_lr'\)",
        ),
        (
            lambda batch: {"eval_acc": jnp.float32(1)},
            r"^loss_fn's aux\['eval_acc'\] has a name the trainer's own metrics use \('eval_\*'\)",
        ),
        (
            lambda batch: {"tokens_per_s": jnp.float32(1)},
            r"\('tokens_per_s'\); rename it",
        ),
        (
            lambda batch: {1: jnp.float32(1)},
            r"^loss_fn's aux has the key 1; name each aux scalar with a non-empty string",
        ),
    ],
    ids=["vector", "string", "complex", "lr", "eval_prefix", "tokens_per_s", "int_key"],
)
def test_a_bad_aux_is_one_line(tmp_path, extra, message):
    with pytest.raises(trainer.ConfigError, match=message) as error:
        train(tmp_path, loss_fn=with_aux(extra))
    assert "\n" not in str(error.value)  # what the CLI prints: one line


def lm_loss_with_aux(model, batch):
    loss, aux = next_token_loss(model, batch)
    return loss, {**aux, "nll": loss}


def mixture_config(corpus, tmp_path, *overrides):
    """A 1-step run of two sources, `code` (the corpus) and `prose`, evaluated at its step
    (unless `overrides` say otherwise)."""
    prose = prepare_dataset(
        documents(40, seed=7), tmp_path / "prose", eval_fraction=0.2, progress=False
    )
    return trainer.load_config(
        None,
        [
            *TINY,
            f"data.mixture=[{{path: '{corpus}', weight: 0.75, name: code}}, "
            f"{{path: '{prose}', weight: 0.25, name: prose}}]",
            f"run.workdir={tmp_path / 'run'}",
            "run.steps=1",
            "eval.every=1",
            "eval.steps=1",
            "log.tensorboard=false",
            *overrides,
        ],
    )


def test_a_mixture_logs_each_sources_eval_aux_and_their_mix(corpus, tmp_path):
    trainer.run(mixture_config(corpus, tmp_path), loss_fn=lm_loss_with_aux)
    (row,) = [r for r in rows_of(tmp_path / "run") if "eval_loss" in r]
    for suffix in ("", "_code", "_prose"):
        assert row[f"eval_nll{suffix}"] == pytest.approx(row[f"eval_loss{suffix}"], rel=1e-6)
    assert not math.isclose(row["eval_nll_code"], row["eval_nll_prose"])


def colliding_aux_loss(model, batch):
    """`nll` on source `code` and the aux `nll_code` are both `eval_nll_code` in eval."""
    loss, aux = next_token_loss(model, batch)
    return loss, {**aux, "nll": loss, "nll_code": jnp.float32(7.0)}


def test_an_aux_named_like_another_aux_on_a_source_is_one_line(corpus, tmp_path):
    """Before: eval_nll_code held source code's nll and the aux nll_code's 7.0 was dropped."""
    with pytest.raises(trainer.ConfigError) as error:
        trainer.run(mixture_config(corpus, tmp_path), loss_fn=colliding_aux_loss)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "loss_fn's aux 'nll' on mixture source 'code' and aux 'nll_code' would both log in "
        "eval as 'eval_nll_code'; rename"
    )


def colliding_in_eval_only_loss(model, batch):
    """The aux `nll_code` only where the model is evaluated (`model.eval()`)."""
    loss, aux = next_token_loss(model, batch)
    extra = {"nll_code": jnp.float32(7.0)} if model.deterministic else {}
    return loss, {**aux, "nll": loss, **extra}


def colliding_in_training_only_loss(model, batch):
    """The aux `nll_code` only in training: eval logs no two values as `eval_nll_code`."""
    loss, aux = next_token_loss(model, batch)
    extra = {} if model.deterministic else {"nll_code": jnp.float32(7.0)}
    return loss, {**aux, "nll": loss, **extra}


def trained_rows(workdir) -> list[dict]:
    """The metrics lines of trained steps (none where the run stopped before its workdir)."""
    metrics = workdir / "metrics.jsonl"
    return [r for r in rows_of(workdir) if "loss" in r] if metrics.exists() else []


@pytest.mark.parametrize("loss_fn", [colliding_aux_loss, colliding_in_eval_only_loss])
def test_an_eval_name_collision_is_refused_before_the_first_step(corpus, tmp_path, loss_fn):
    """Before: refused at the first eval, here the last step's, after training every step (a
    long eval.every: hours of training)."""
    config = mixture_config(corpus, tmp_path, "run.steps=2", "eval.every=1000")
    with pytest.raises(trainer.ConfigError, match=r"^loss_fn's aux 'nll' on mixture source"):
        trainer.run(config, loss_fn=loss_fn)
    assert trained_rows(tmp_path / "run") == []


def test_a_collision_in_training_only_is_not_refused(corpus, tmp_path):
    """Train lines have no per-source names: only what the eval step returns can collide."""
    trainer.run(mixture_config(corpus, tmp_path), loss_fn=colliding_in_training_only_loss)
    (line,) = trained_rows(tmp_path / "run")
    assert line["nll_code"] == 7.0
    (row,) = [r for r in rows_of(tmp_path / "run") if "eval_loss" in r]
    assert row["eval_nll_code"] == pytest.approx(row["eval_loss_code"], rel=1e-6)
