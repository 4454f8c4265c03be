"""float16 compute with dynamic loss scaling: it trains like bf16, an overflow skips exactly one
step and halves the scale, the scale grows back, accumulation matches one batch, and a scale
that collapses stops the run with one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY

import trainer
from trainer.config import PrecisionConfig, load_config
from trainer.data import dataset_sources, load_dataset
from trainer.errors import TrainingError
from trainer.loss_scale import LossScaling
from trainer.models import builder_for_vocab
from trainer.parallel import sharding
from trainer.program import build_program
from trainer.step import next_token_loss

STEPS = 200
# One learning-rate schedule for every session of a resumed run below: its length is compiled
# into the train step, so sessions of any run.steps with this one share a compiled step (JAX's
# compilation cache, `conftest.shared_compile_cache`) instead of each compiling its own.
SESSION_SCHEDULE = "optim.decay_steps=8"


def boosted_loss(model, batch):
    """The LM loss times `batch["boost"]` (1 normally): a boost of 1e30 overflows the gradients."""
    loss, aux = next_token_loss(model, batch)
    return loss * batch["boost"][0], aux


def tiny_program(corpus, mesh_shape=(1, 1, 1), overrides=(), loss_fn=next_token_loss):
    config = load_config(
        None,
        [*TINY, f"data.path={corpus}", f"run.steps={STEPS}", "optim.lr=3e-3", *overrides],
    )
    data, fsdp, tensor = mesh_shape
    config = config.derive({"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor})
    mesh = sharding.make_mesh(config.mesh, jax.devices()[: data * fsdp * tensor])
    vocab = load_dataset(config.data).vocab_size
    return build_program(config, mesh, builder_for_vocab(config, vocab), loss_fn), config


@pytest.fixture(scope="module")
def host_batches(corpus):
    config = load_config(None, [*TINY, f"data.path={corpus}"])
    batches = dataset_sources(config.data, seed=config.run.seed).train
    return [next(batches) for _ in range(STEPS)]


def train(program, batches, boosts=None):
    """Losses and per-step metrics of `program` over `batches` (a boost per step if given)."""
    state = program.init()
    rows = []
    with jax.set_mesh(program.mesh):
        for i, batch in enumerate(batches):
            if boosts is not None:
                batch = {**batch, "boost": np.full(len(batch["inputs"]), boosts[i], np.float32)}
            state, metrics = program.train_step(
                state, jax.device_put(batch, program.batch_sharding)
            )
            rows.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return rows, state


def final_loss(rows) -> float:
    return float(np.mean([r["loss"] for r in rows[-20:]]))


def test_scale_halves_on_overflow_and_doubles_after_a_clean_period():
    scaling = LossScaling.from_config(PrecisionConfig(compute="float16", loss_scale_period=3))
    state = scaling.init()
    assert float(state.scale) == 2.0**15
    state = scaling.update(state, jnp.bool_(False))
    assert float(state.scale) == 2.0**14 and int(state.clean_steps) == 0
    for _ in range(3):
        state = scaling.update(state, jnp.bool_(True))
    assert float(state.scale) == 2.0**15 and int(state.clean_steps) == 0
    bounded = LossScaling(initial=2.0, period=1, minimum=1.0, maximum=4.0)
    state = bounded.init()
    for _ in range(3):
        state = bounded.update(state, jnp.bool_(True))
    assert float(state.scale) == 4.0  # kept at the maximum
    for _ in range(5):
        state = bounded.update(state, jnp.bool_(False))
    assert float(state.scale) == 1.0  # kept at the minimum
    assert LossScaling.from_config(PrecisionConfig(compute="bfloat16")) is None


@pytest.mark.slow
def test_float16_trains_like_bfloat16_on_one_and_eight_devices(corpus, host_batches):
    """200 steps: fp16 ends within 2% of bf16, on 1 device and on a data x fsdp x tensor mesh."""
    reference = final_loss(train(tiny_program(corpus)[0], host_batches)[0])
    for mesh_shape in [(1, 1, 1), (2, 2, 2)]:
        program, _ = tiny_program(corpus, mesh_shape, ["precision.compute=float16"])
        rows, _ = train(program, host_batches)
        assert final_loss(rows) == pytest.approx(reference, rel=0.02), mesh_shape
        assert final_loss(rows) < rows[0]["loss"] - 1.0  # it learns
        assert all(r["loss_scale"] >= 1.0 for r in rows)


def test_an_overflow_skips_that_step_alone_and_halves_the_scale(corpus, host_batches):
    program, _ = tiny_program(
        corpus,
        (2, 2, 2),
        ["precision.compute=float16", "precision.loss_scale_period=3"],
        loss_fn=boosted_loss,
    )
    batches = host_batches[:8]
    boosts = [1.0, 1.0, 1e30, 1.0, 1.0, 1.0, 1.0, 1.0]  # step 3 overflows
    state = program.init()
    rows = []
    with jax.set_mesh(program.mesh):
        for i, batch in enumerate(batches):
            batch = {**batch, "boost": np.full(len(batch["inputs"]), boosts[i], np.float32)}
            before = jax.device_get((state.params, state.opt_state))
            state, metrics = program.train_step(
                state, jax.device_put(batch, program.batch_sharding)
            )
            rows.append({k: float(v) for k, v in jax.device_get(metrics).items()})
            if i == 2:
                after = jax.device_get((state.params, state.opt_state))
                for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
                    np.testing.assert_array_equal(a, b)  # parameters and moments untouched
    assert [r["skipped"] for r in rows] == [0, 0, 1, 0, 0, 0, 0, 0]
    scales = [r["loss_scale"] for r in rows]  # the scale each step ran with
    # 2 clean steps, the overflow halves, 3 clean steps double it again
    assert scales == [2.0**15, 2.0**15, 2.0**15, 2.0**14, 2.0**14, 2.0**14, 2.0**15, 2.0**15]


def test_float16_accumulation_matches_one_full_batch(corpus, host_batches):
    full_rows, full = train(
        tiny_program(corpus, (2, 2, 2), ["precision.compute=float16"])[0], host_batches[:3]
    )
    accum_rows, accum = train(
        tiny_program(corpus, (2, 2, 2), ["precision.compute=float16", "optim.accum_steps=4"])[0],
        host_batches[:3],
    )
    np.testing.assert_allclose(
        [r["loss"] for r in accum_rows], [r["loss"] for r in full_rows], rtol=2e-3
    )
    for a, b in zip(jax.tree.leaves(accum.params), jax.tree.leaves(full.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=2e-4)


def test_a_collapsed_scale_stops_the_run_with_one_line(corpus, host_batches, tmp_path):
    """Every step overflows: the scale falls to its minimum, and the next overflow stops the run
    naming the step and the fixes, instead of skipping (training on nothing) for ever."""
    config = load_config(
        None,
        [
            *TINY,
            f"data.path={corpus}",
            f"run.workdir={tmp_path}",
            "run.steps=20",
            "precision.compute=float16",
            "precision.loss_scale_init=4",
            "precision.loss_scale_min=1",
            "log.progress=false",
        ],
    )
    boosted = ({**b, "boost": np.full(len(b["inputs"]), 1e30, np.float32)} for b in host_batches)
    build = builder_for_vocab(config, load_dataset(config.data).vocab_size)
    model = lambda rngs: build(rngs=rngs)  # noqa: E731  (a factory, as a library user brings)
    with pytest.raises(TrainingError) as caught:
        trainer.run(config, model=model, loss_fn=boosted_loss, data=boosted)
    message = str(caught.value)
    assert "\n" not in message
    assert "at step 3" in message and "loss_scale_min" in message and "optim.lr" in message


def test_a_resume_may_change_precision_and_a_layout_change_is_one_line(corpus, tmp_path):
    """The overflow line advises bf16 or fp32; before, following it renamed every checkpoint
    to `<step>.damaged` (the saved loss scale made the state's tree differ) and exited 2 with
    'start fresh with another run.workdir', as did float16 after fp32, and `optim.clip_norm`
    null after a number."""
    from trainer.errors import ConfigError

    def session(steps, *overrides):
        every = ["checkpoint.every=2", "eval.every=100", "log.tensorboard=false", SESSION_SCHEDULE]
        paths = [f"data.path={corpus}", f"run.workdir={tmp_path}", f"run.steps={steps}"]
        trainer.run(load_config(None, [*TINY, *paths, *every, *overrides]))

    session(2, "precision.compute=float16")
    session(4, "precision.compute=float32")  # the float16 scale is dropped
    session(6, "precision.compute=float16")  # a fresh scale after fp32
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scales = {r["step"]: r.get("loss_scale") for r in rows if "loss" in r}
    initial = PrecisionConfig().loss_scale_init
    assert scales == {1: initial, 2: initial, 3: None, 4: None, 5: initial, 6: initial}

    with pytest.raises(ConfigError) as refused:
        session(8, "precision.compute=float16", "optim.clip_norm=null")
    assert f"checkpoint {tmp_path / 'checkpoints/6'} holds optimizer or model state laid out " in (
        str(refused.value)
    )
    assert "(optim.clip_norm: saved 1.0, now null); resume with the settings" in str(refused.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4", "6"]


def test_skipped_steps_counts_on_across_a_resume(corpus, tmp_path):
    """A scale of 1e30 overflows every step. Before: a resumed session logged `skipped_steps`
    from 1 again (1, 2, then 1, 2), though the metric is the run's total."""
    scale = ["precision.loss_scale_init=1e30", "precision.loss_scale_max=1e30"]
    for steps in (2, 4):
        config = load_config(
            None,
            [
                *TINY,
                f"data.path={corpus}",
                f"run.workdir={tmp_path}",
                f"run.steps={steps}",
                SESSION_SCHEDULE,
                "checkpoint.every=2",
                "eval.every=100",
                "log.tensorboard=false",
                "precision.compute=float16",
                *scale,
            ],
        )
        trainer.run(config)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows if "loss" in r] == [1, 2, 3, 4]
