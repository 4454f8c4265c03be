"""`python -m trainer.plan` builds the model with the vocabulary the trainer would: with
`model.vocab_size` unset, the prepared dataset's (`data.path`, or a mixture's), read from its
`dataset.json`. It planned a byte-level (256) model whatever the dataset's tokenizer was: for a
32k-token dataset that left out most of the embedding, the output head and the logits. A dataset
that is not here yet is planned at 256, with one line saying so and naming the key to set."""

import jax
import pytest
from conftest import documents

from trainer import plan
from trainer.config import load_config
from trainer.models import builder_for_vocab
from trainer.parallel import sharding
from trainer.plan import measure
from trainer.plan.vocab import planned_vocab
from trainer.program import build_program

TINY = "configs/tiny.yaml"
VOCAB = 320


@pytest.fixture(scope="module")
def sentencepiece_data(tmp_path_factory):
    """A prepared dataset whose vocabulary is not the byte-level 256."""
    from input_pipeline.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("plan_vocab") / "sp"
    prepare_dataset(documents(), out, tokenizer="sentencepiece", vocab_size=VOCAB, progress=False)
    return out


@pytest.fixture(autouse=True)
def in_repo(monkeypatch, repo_root):
    monkeypatch.chdir(repo_root)


def trainer_params(config, vocab: int) -> int:
    """The parameter count of the model the trainer builds for `config` on `vocab` tokens."""
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:2])
    return build_program(config, mesh, builder_for_vocab(config, vocab)).num_params


def test_the_plan_builds_the_model_on_the_datasets_vocabulary(sentencepiece_data):
    config = load_config(TINY, [f"data.path={sentencepiece_data}"])
    planned = measure(config, jax.devices()[:2])
    assert planned.num_params == trainer_params(config, VOCAB)
    assert planned.num_params != trainer_params(config, 256)


def test_a_mixture_plans_on_its_vocabulary_and_model_vocab_size_wins(sentencepiece_data):
    mixture = f"data.mixture=[{{path: {sentencepiece_data}, weight: 1.0}}]"
    assert planned_vocab(load_config(TINY, [mixture])) == VOCAB
    wider = [f"data.path={sentencepiece_data}", "model.vocab_size=512"]
    assert planned_vocab(load_config(TINY, wider)) == 512


def test_a_dataset_not_here_is_planned_at_256_and_said_so(tmp_path, capsys):
    missing = tmp_path / "not_prepared_yet"
    assert plan.main(["--config", TINY, "--devices", "2", f"data.path={missing}"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "model.vocab_size" in line]
    assert len(notes) == 1, out
    assert str(missing) in notes[0] and "256" in notes[0], notes[0]


def test_a_damaged_dataset_json_is_one_line_and_exit_2(tmp_path, capsys):
    folder = tmp_path / "damaged"
    folder.mkdir()
    (folder / "dataset.json").write_text("{not json")
    assert plan.main(["--config", TINY, "--devices", "2", f"data.path={folder}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "dataset.json" in err and "model.vocab_size" in err, err


def test_a_vocab_size_below_the_datasets_is_refused_as_the_trainer_does(sentencepiece_data, capsys):
    """The trainer refuses it at setup; the plan planned it."""
    args = [f"data.path={sentencepiece_data}", "model.vocab_size=100"]
    assert plan.main(["--config", TINY, "--devices", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: model.vocab_size=100 is smaller than the dataset's vocabulary ({VOCAB}); raise "
        "model.vocab_size or leave it unset\n"
    )
