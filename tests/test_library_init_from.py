"""`checkpoint.init_from` of a caller's model with BatchNorm: the new run starts from the source's
parameters and its batch statistics. Before, the statistics started fresh (mean 0, variance 1),
so the fine-tuned model normalised its inputs by the wrong moments (eval_loss 5.61 on the source,
55.94 after one init_from step at lr 1e-9)."""

import jax
import numpy as np
from flax import nnx

import trainer
from tests.test_library import FEATURES, Classifier, classification_loss, config_for, train_data
from trainer.checkpoint import Checkpointer
from trainer.models import run_model
from trainer.parallel import sharding
from trainer.program import build_program
from trainer.train import init_from


class NormedClassifier(Classifier):
    """The MLP with BatchNorm on its input (running statistics) and a dropout stream."""

    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.norm = nnx.BatchNorm(FEATURES, momentum=0.5, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(self.norm(x)))))


def leaves(tree):
    """Each leaf by its path, a random key as its key data (comparable as an array)."""
    return {
        jax.tree_util.keystr(path): jax.random.key_data(leaf)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        else np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def test_init_from_carries_batch_statistics_but_not_random_streams(tmp_path):
    source = tmp_path / "source"
    config = config_for(source, 4).derive({"checkpoint.every": 4, "eval.every": 100})
    trainer.run(config, model=NormedClassifier, loss_fn=classification_loss, data=train_data())
    spec, build = run_model(config, NormedClassifier, 0)
    program = build_program(config, sharding.make_mesh(config.mesh), build, classification_loss)
    checkpointer, _ = Checkpointer.open_existing(source, fix="")
    try:
        saved, _, _ = checkpointer.restore(checkpointer.latest_step(), program.abstract_state())
    finally:
        checkpointer.close()

    started, fresh = init_from(str(source), program, spec), program.init()

    for name, leaf in leaves(started.params).items():
        np.testing.assert_array_equal(leaf, leaves(saved.params)[name])
    statistics = ["['norm']['mean']", "['norm']['var']"]
    assert np.abs(np.asarray(leaves(saved.model_state)[statistics[0]])).max() > 0.1  # trained
    for name, leaf in leaves(started.model_state).items():
        expected = saved if name in statistics else fresh  # a new run draws its own dropout
        np.testing.assert_array_equal(leaf, leaves(expected.model_state)[name], err_msg=name)
