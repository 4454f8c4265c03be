"""Library use, a caller's data mistakes: batches that are not dicts, and a loss that reads a key
the batches lack, each one line naming the fix (`trainer.caller_batches.BatchDicts`,
`trainer.step._check_key_in_batch`)."""

import json

import grain
import numpy as np
import pytest
from flax import nnx

import trainer
from input_pipeline.errors import DataError
from tests.test_library import Classifier, blobs, classification_loss, config_for, train_data
from trainer.data import user_sources
from trainer.train import eval_mode_warning

X = np.stack([example["x"] for example in blobs(64, 0)])
Y = np.stack([example["y"] for example in blobs(64, 0)])


def run(tmp_path, data, eval_data=None, steps=2):
    return trainer.run(
        config_for(tmp_path, steps).derive({"eval.every": 1}),
        model=Classifier,
        loss_fn=classification_loss,
        data=data,
        eval_data=eval_data,
    )


@pytest.mark.parametrize(
    "data, message",
    [
        ({"x": X, "y": Y}, "data is one dict, and iterating it gives its keys, not batches"),
        (X, "data is one ndarray, and iterating it gives its rows, not batches"),
    ],
    ids=["dict of arrays", "one array"],
)
def test_one_batch_passed_as_the_data_is_one_line(tmp_path, data, message):
    """Before: `AttributeError: 'str' object has no attribute 'items'` from the device feed."""
    with pytest.raises(trainer.ConfigError, match=message):
        run(tmp_path, data)


def test_batches_that_are_not_dicts_are_one_line(tmp_path):
    """Before: `AttributeError: 'tuple' object has no attribute 'items'` from the device feed."""
    with pytest.raises(DataError, match="data yielded a tuple, not a batch dict"):
        run(tmp_path, [(X[:32], Y[:32])] * 3)


def test_a_key_the_batches_lack_is_one_line(tmp_path):
    """Before: `KeyError: 'x'` from inside the backward pass."""
    batches = [{"features": X[:32], "y": Y[:32]}] * 3
    with pytest.raises(DataError, match=r"KeyError\('x'\), a key the batch lacks: it has \["):
        run(tmp_path, batches)


def scale_for(mode):
    return {"eval": 1.0}[mode]


def test_a_key_error_of_the_losss_own_lookup_stays_itself(tmp_path):
    """A KeyError from a lookup that is not on the batch is not blamed on the data."""

    def loss_fn(model, batch):
        loss, aux = classification_loss(model, batch)
        return loss * scale_for("train"), aux

    with pytest.raises(KeyError, match="train"):
        trainer.run(config_for(tmp_path, 1), model=Classifier, loss_fn=loss_fn, data=train_data())


def test_eval_batches_are_checked_the_same_way(tmp_path):
    """Before: `KeyError: 'x'` from the first eval, after training had started."""
    held_out = (
        grain.MapDataset.source(blobs(64, 1))
        .batch(32)
        .map(lambda batch: {"inputs": batch["x"], "y": batch["y"]})
    )
    with pytest.raises(DataError, match=r"KeyError\('x'\), a key the batch lacks"):
        run(tmp_path, train_data(), eval_data=held_out, steps=1)


def test_examples_yielded_unbatched_are_one_line(tmp_path):
    """Before: `IndexError: list index out of range` from JAX's sharding code."""
    examples = grain.MapDataset.source(blobs(64, 0)).repeat()
    with pytest.raises(DataError, match="field 'y' is a scalar: an example, not a batch"):
        run(tmp_path, examples)


def test_fields_of_other_row_counts_are_one_line(tmp_path):
    """Before: trained, each field split over the devices its own way (the 16 labels of a
    32-row batch: a loss over the wrong pairs, or a shape error from inside the loss)."""
    with pytest.raises(DataError, match="different row counts \\('x': 32, 'y': 16\\)"):
        run(tmp_path, [{"x": X[:32], "y": Y[:16]}] * 3)


class DropoutClassifier(Classifier):
    def __init__(self, rngs):
        super().__init__(rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


def test_a_module_left_in_eval_mode_is_named():
    """Before: a module handed over after `model.eval()` trained with its dropout off (and a
    BatchNorm's statistics frozen) without a word; `trainer.run` prints this line at start."""
    with nnx.use_eager_sharding(False):  # logical axis names are not mesh axes yet
        module = DropoutClassifier(nnx.Rngs(0))
    assert eval_mode_warning(module) is None and eval_mode_warning(DropoutClassifier) is None
    module.eval()
    assert eval_mode_warning(module) == (
        "warning: the model passed to trainer.run is in eval mode (dropout): it trains with "
        "dropout off and BatchNorm statistics frozen; call model.train() before trainer.run, "
        "unless that is what you mean"
    )


def test_a_grain_data_loaders_position_goes_through_a_checkpoints_json():
    """Before: `TypeError: Object of type bytes is not JSON serializable` from the checkpoint's
    writer thread at the first save (a DataLoader's get_state returns bytes; the data position
    item is JSON)."""

    def loader():
        sampler = grain.samplers.IndexSampler(64, shuffle=True, seed=0, num_epochs=None)
        batch = grain.transforms.Batch(32)
        return grain.DataLoader(
            data_source=blobs(64, 0), sampler=sampler, operations=[batch], worker_count=0
        )

    first = user_sources(loader()).train
    next(first)
    saved = json.loads(json.dumps(first.get_state()))
    expected = next(first)
    resumed = user_sources(loader()).train
    resumed.set_state(saved)
    assert all(
        (resumed_value == expected[key]).all() for key, resumed_value in next(resumed).items()
    )


class NumpyPosition:
    """Batches whose position is a numpy integer: JSON cannot hold it."""

    def __iter__(self):
        return self

    def __next__(self):
        return {"x": X[:32], "y": Y[:32]}

    def get_state(self):
        return {"index": np.int64(1)}

    def set_state(self, state):
        pass


def test_a_position_a_checkpoint_cannot_hold_is_one_line():
    """Before: a TypeError from the checkpoint's writer thread at the first save."""
    batches = user_sources(NumpyPosition()).train
    next(batches)
    with pytest.raises(DataError, match="data's get_state\\(\\) returned a position a checkpoint"):
        batches.get_state()
