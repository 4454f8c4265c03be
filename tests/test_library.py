"""Library use: a caller's own nnx.Module, loss and (non-text) data through `trainer.run`, and
the README's library example run exactly as printed."""

import json
import math
import re
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import trainer
from input_pipeline.errors import DataError

FEATURES, CLASSES = 16, 4
README_SECTION = "## Library use: your own model, loss and data"


def readme_library_example(readme: str) -> str:
    """The first ```python block under the library-use heading, as a reader copies it."""
    section = readme[readme.index(README_SECTION) :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.mark.slow
def test_readme_library_example_runs_verbatim(repo_root, tmp_path, monkeypatch, capsys):
    # Executed unedited, so the README cannot drift from the API. It names its paths relative
    # to the repository root (`configs/tiny.yaml`, `workdirs/clf`): run it from a temporary
    # folder that sees the repository's configs, so its workdir lands in tmp_path.
    source = readme_library_example((repo_root / "README.md").read_text())
    (tmp_path / "configs").symlink_to(repo_root / "configs")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(source, "README.md", "exec"), namespace)

    result = namespace["result"]
    rows = [
        json.loads(x) for x in (tmp_path / "workdirs/clf/metrics.jsonl").read_text().splitlines()
    ]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert result.step == 100 and rows[-1]["step"] == 100
    assert math.isfinite(result.eval_loss)
    assert result.eval_loss < 0.5 * math.log(4) and result.eval_loss < losses[0]
    assert (tmp_path / "workdirs/clf/checkpoints/100").is_dir()
    assert str(result.eval_loss) in capsys.readouterr().out  # the example's own print


class Classifier(nnx.Module):
    """A small MLP whose weights name their axes, so the rules table shards them."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.hidden = nnx.Linear(
            FEATURES,
            64,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)),
        )
        self.out = nnx.Linear(
            64,
            CLASSES,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("mlp", "vocab")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("vocab",)),
        )

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def classification_loss(model, batch):
    logits = model(batch["x"]).astype(jnp.float32)
    labels = batch["y"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1)[:, 0]
    accuracy = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
    return jnp.mean(nll), {"weight": jnp.float32(labels.shape[0]), "accuracy": accuracy}


def blobs(n, seed):
    """Four Gaussian clusters: learnable to near-100% accuracy in a few dozen steps."""
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(123).normal(0, 3, (CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, n)
    x = centers[y] + rng.normal(0, 1, (n, FEATURES))
    return [{"x": x[i].astype(np.float32), "y": np.int32(y[i])} for i in range(n)]


def train_data(seed=0):
    return grain.MapDataset.source(blobs(2048, seed)).shuffle(seed=seed).repeat().batch(32)


def config_for(workdir, steps):
    return trainer.load_config(
        None,
        [
            f"run.workdir={workdir}",
            f"run.steps={steps}",
            "optim.lr=1e-2",
            "optim.warmup_steps=2",
            "optim.decay_steps=30",
            "log.every=1",
            "log.progress=false",
            "eval.every=10",
            "eval.steps=4",
            "checkpoint.every=10",
            "mesh.data=4",
            "mesh.fsdp=2",
        ],
    )


def test_custom_model_loss_and_data_train_and_evaluate(tmp_path):
    eval_batches = grain.MapDataset.source(blobs(256, 99)).batch(64)
    result = trainer.run(
        config_for(tmp_path, 30),
        model=Classifier,
        loss_fn=classification_loss,
        data=train_data(),
        eval_data=eval_batches,
    )
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.3 * losses[0]
    assert result.eval_loss is not None and result.eval_loss < 0.3
    kernel = result.state.params["hidden"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


def test_grain_data_position_is_checkpointed_and_resumed(tmp_path):
    straight = trainer.run(
        config_for(tmp_path / "a", 20),
        model=Classifier,
        loss_fn=classification_loss,
        data=train_data(),
    )
    trainer.run(
        config_for(tmp_path / "b", 10),
        model=Classifier,
        loss_fn=classification_loss,
        data=train_data(),
    )
    resumed = trainer.run(
        config_for(tmp_path / "b", 20),
        model=Classifier,
        loss_fn=classification_loss,
        data=train_data(),
    )
    for a, b in zip(
        jax.tree.leaves(straight.state.params), jax.tree.leaves(resumed.state.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_plain_iterables_and_built_modules_work_too(tmp_path):
    def batches():
        for batch in train_data():
            yield {k: np.asarray(v) for k, v in batch.items()}

    with nnx.use_eager_sharding(False):  # logical axis names are not mesh axes yet
        module = Classifier(nnx.Rngs(3))
    result = trainer.run(
        config_for(tmp_path, 5), model=module, loss_fn=classification_loss, data=batches()
    )
    assert result.step == 5


def test_resuming_data_without_a_position_says_it_starts_again(tmp_path, capsys):
    """A plain generator has no position to checkpoint: a resume used to train on its first
    batches again without a word. A Grain iterator's resume says nothing (it resumes exactly)."""

    def batches():
        yield from train_data()

    for steps, data in [(10, batches()), (12, train_data()), (14, batches())]:
        config = config_for(tmp_path, steps)
        trainer.run(config, model=Classifier, loss_fn=classification_loss, data=data)
        warnings = [line for line in capsys.readouterr().err.splitlines() if "starts again" in line]
        if steps == 10 or steps == 12:  # a fresh start; a Grain iterator's resume
            assert warnings == []
        else:
            assert warnings == [
                "warning: the training data has no get_state/set_state, so it starts again from "
                "its first batch: step 13 trains on what step 1 did; pass an iterator with "
                "get_state/set_state (a Grain dataset's has) to resume its position"
            ]


def test_init_from_a_hugging_face_folder_needs_the_models_adapter(tmp_path):
    """A caller's model has no Hugging Face mapping: one line, not the transformer's mapping."""
    hf = f"hf:{Path(__file__).parent / 'fixtures' / 'hf_tiny_llama'}"
    config = config_for(tmp_path, 5).derive({"checkpoint.init_from": hf})
    with pytest.raises(trainer.ConfigError, match="this model has no Hugging Face adapter"):
        trainer.run(config, model=Classifier, loss_fn=classification_loss, data=train_data())


def test_finite_data_that_runs_out_is_reported(tmp_path):
    short = grain.MapDataset.source(blobs(64, 0)).batch(32)  # two batches, no repeat
    with pytest.raises(trainer.TrainingError, match="training data ran out before step 3"):
        trainer.run(
            config_for(tmp_path, 5), model=Classifier, loss_fn=classification_loss, data=short
        )


class Unannotated(nnx.Module):
    """A model written without any sharding in mind."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 64, rngs=rngs)
        self.out = nnx.Linear(64, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


AXES = [
    (r".*hidden/kernel", ("embed", "mlp")),
    (r".*hidden/bias", ("mlp",)),
    (r".*out/kernel", ("mlp", None)),
]


def test_annotate_axes_shards_a_model_written_without_axes(tmp_path):
    config = config_for(tmp_path, 3)
    config = config.derive({"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    result = trainer.run(
        config,
        model=lambda rngs: trainer.annotate_axes(Unannotated(rngs), AXES),
        loss_fn=classification_loss,
        data=train_data(),
    )
    params = result.state.params
    assert params["hidden"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert params["out"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    assert params["out"]["bias"].sharding.spec == jax.sharding.PartitionSpec()  # unmatched


def test_annotate_axes_rejects_a_rank_mismatch():
    with nnx.use_eager_sharding(False), pytest.raises(trainer.ConfigError, match="rank 2"):
        trainer.annotate_axes(Unannotated(nnx.Rngs(0)), [(r"hidden/kernel", ("embed",))])


# ----------------------------------------------------------------------------- caller mistakes


def loss_returning(make_result):
    """A loss_fn built on `classification_loss` that returns `make_result(loss, aux)`."""
    return lambda model, batch: make_result(*classification_loss(model, batch))


WRONG_LOSSES = {
    "per-example losses": (
        lambda model, batch: (model(batch["x"])[:, 0], {}),
        "loss that is float32 of shape \\(32,\\); return one float scalar",
    ),
    "the loss alone": (loss_returning(lambda loss, aux: loss), "a single value"),
    "three values": (loss_returning(lambda loss, aux: (loss, aux, 1)), "returned 3 values"),
    "aux None": (loss_returning(lambda loss, aux: (loss, None)), "aux .* is None"),
    "a vector weight": (
        loss_returning(lambda loss, aux: (loss, {"weight": jnp.ones(3)})),
        "aux\\['weight'\\] is float32 of shape \\(3,\\)",
    ),
    # an integer loss has zero gradients: it trained nothing, silently
    "an integer loss": (
        loss_returning(lambda loss, aux: (loss.astype(jnp.int32), aux)),
        "loss that is int32",
    ),
}


@pytest.mark.parametrize("mistake", list(WRONG_LOSSES))
def test_a_loss_fn_returning_the_wrong_thing_is_one_line(tmp_path, mistake):
    """Before: a JAX error about gradients from inside the backward pass, or (an int loss) a run
    that trained nothing."""
    loss_fn, message = WRONG_LOSSES[mistake]
    with pytest.raises(trainer.ConfigError, match=message):
        trainer.run(config_for(tmp_path, 2), model=Classifier, loss_fn=loss_fn, data=train_data())


def test_the_default_loss_on_other_batches_names_loss_fn(tmp_path):
    """Before: `ValueError: entry not a 2- or 3- tuple` from numpy, deep in the backward pass."""
    with pytest.raises(DataError, match="reads batch keys 'targets' and 'weights'.*loss_fn="):
        trainer.run(config_for(tmp_path, 2), model=Classifier, data=train_data())


class KeywordRngs(Classifier):
    """Flax's own convention: `rngs` keyword-only."""

    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs)


def test_a_model_class_taking_rngs_by_keyword_trains(tmp_path):
    result = trainer.run(
        config_for(tmp_path, 2), model=KeywordRngs, loss_fn=classification_loss, data=train_data()
    )
    assert result.step == 2


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: Classifier(nnx.Rngs(0)), "takes \\(\\), not rngs alone"),
        (lambda rngs, width: Classifier(rngs), "takes \\(rngs, width\\)"),
        (lambda rngs: (Classifier(rngs),), "returned tuple, not an nnx.Module"),
    ],
    ids=["no rngs", "two arguments", "not a module"],
)
def test_a_factory_of_the_wrong_shape_is_one_line(tmp_path, factory, message):
    with pytest.raises(trainer.ConfigError, match=message):
        trainer.run(
            config_for(tmp_path, 2), model=factory, loss_fn=classification_loss, data=train_data()
        )


def test_batches_that_do_not_split_into_accum_steps_are_one_line(tmp_path):
    """A caller's 40-row batches and optim.accum_steps=16 (data.global_batch_size, 32 by default,
    divides). Before: a reshape TypeError from inside the jitted step."""
    config = config_for(tmp_path, 2).derive({"optim.accum_steps": 16})
    with pytest.raises(trainer.ConfigError, match="40 rows .* optim.accum_steps=16"):
        trainer.run(
            config,
            model=Classifier,
            loss_fn=classification_loss,
            data=grain.MapDataset.source(blobs(400, 0)).repeat().batch(40),
        )


def lm_batches(token_dtype=np.int32, drop=()):
    """A caller's own LM batches for the built-in transformer (vocabulary 64)."""
    rng = np.random.default_rng(0)
    while True:
        tokens = rng.integers(0, 64, (16, 17))
        batch = {
            "inputs": tokens[:, :-1].astype(token_dtype),
            "targets": tokens[:, 1:].astype(np.int32),
            "weights": np.ones((16, 16), np.float32),
        }
        yield {k: v for k, v in batch.items() if k not in drop}


@pytest.mark.parametrize(
    ("batches", "message"),
    [
        (lm_batches(np.float32), "batch\\['inputs'\\] is float32 of shape \\(16, 16\\)"),
        (lm_batches(drop=("inputs",)), "reads batch key 'inputs'"),
        (lm_batches(drop=("weights",)), "reads batch keys 'targets' and 'weights'"),
    ],
    ids=["float tokens", "no inputs", "no weights"],
)
def test_the_built_in_model_names_what_a_callers_lm_batch_lacks(tmp_path, batches, message):
    """Before: flax's "Input type must be an integer" or a KeyError from inside the step."""
    config = config_for(tmp_path, 2).derive(
        {"model.vocab_size": 64, "model.num_layers": 1, "model.d_model": 32, "model.d_ff": 64}
    )
    with pytest.raises(DataError, match=message):
        trainer.run(config, data=batches)


@pytest.mark.parametrize(
    "data, eval_data, message",
    [
        (None, lambda: iter(()), None),  # a function returning fresh iterators: accepted
        (None, (b for b in []), "eval_data is a one-shot generator"),
        (42, None, "data=42 is not iterable"),
        (None, 5, "eval_data=5 is not iterable"),
    ],
    ids=["fresh iterators", "generator", "data not iterable", "eval_data not iterable"],
)
def test_data_that_cannot_serve_the_run_is_refused_before_training(
    tmp_path, data, eval_data, message
):
    """A generator as eval_data used to pass its first eval and kill the run at the second,
    blaming data.global_batch_size; a non-iterable ended in Python's TypeError."""
    from trainer.data import user_sources

    make = lambda: user_sources(train_data() if data is None else data, eval_data)  # noqa: E731
    if message is None:
        assert list(make().make_eval()) == []  # each eval calls it for a fresh pass
        return
    with pytest.raises(trainer.ConfigError, match=message):
        make()


def test_a_callers_batch_size_is_its_own_and_is_checked_against_the_mesh(tmp_path):
    """Before: 24-row batches with optim.accum_steps=3 were refused for data.global_batch_size
    (32, which the caller's data does not use), and 12-row batches on 8 devices ended in jax's
    IndivisibleError."""
    config = config_for(tmp_path / "a", 2).derive({"optim.accum_steps": 3})
    batches = lambda rows: grain.MapDataset.source(blobs(240, 0)).repeat().batch(rows)  # noqa: E731
    run = lambda config, rows: trainer.run(  # noqa: E731
        config, model=Classifier, loss_fn=classification_loss, data=batches(rows)
    )
    assert run(config, 24).step == 2
    with pytest.raises(DataError, match="'x' has shape \\(12, 16\\).* multiple of 8 rows"):
        run(config_for(tmp_path / "b", 2), 12)


def with_value(batches, step: int, field: str, value):
    """`batches` with `value` written into one item of `field` in the batch of `step` (from 1)."""
    for index, batch in enumerate(batches, start=1):
        if index == step:
            batch = {**batch, field: batch[field].copy()}
            batch[field][2, 5] = value
        yield batch


LM_MODEL = {"model.vocab_size": 64, "model.num_layers": 1, "model.d_model": 32, "model.d_ff": 64}


@pytest.mark.parametrize(
    ("field", "token", "found"),
    [("inputs", 70, "up to 70 in 'inputs'"), ("targets", -1000, "down to -1000 in 'targets'")],
)
def test_token_ids_outside_the_vocabulary_are_named_as_the_nan_losss_cause(
    tmp_path, field, token, found
):
    """A caller's ids >= model.vocab_size (or < 0) gather nothing and make the loss NaN. Before:
    the NaN line listed them among four possible causes; now the run says which ids, once the
    loss is NaN (nothing is checked per step)."""
    config = config_for(tmp_path, 5).derive({**LM_MODEL, "checkpoint.every": 2})
    with pytest.raises(trainer.TrainingError) as caught:
        trainer.run(config, data=with_value(lm_batches(), 3, field, token))
    assert str(caught.value) == (
        f"step 3's batch holds token ids {found}, outside model.vocab_size=64, and its loss is "
        "nan; it is not saved (earlier checkpoints are kept). Keep every token id in [0, 64) "
        "(check the data's tokenizer), or raise model.vocab_size to cover them"
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


def test_a_callers_model_is_not_checked_against_a_model_vocab_size_it_does_not_use(tmp_path):
    """A caller's module with 128 token ids and a model.vocab_size=64 it was not built from:
    its ids 64-127 are not the cause of a NaN loss (here a NaN weight), and are not blamed."""
    from trainer.models import builder_for_vocab

    config = config_for(tmp_path, 5).derive(LM_MODEL)
    build = builder_for_vocab(config, 128)
    batches = with_value(with_value(lm_batches(), 3, "inputs", 100), 3, "weights", np.nan)
    with pytest.raises(trainer.TrainingError, match="^loss is nan at step 3; it is not saved"):
        trainer.run(config, model=lambda rngs: build(rngs=rngs), data=batches)
