"""The vocabulary the plan builds the model with: the trainer's (`model.vocab_size`, else the
prepared dataset's), read from `dataset.json` alone, so no data is read or prepared to plan."""

from __future__ import annotations

from pathlib import Path

from input_pipeline.corpora import BUILTIN_CORPORA
from input_pipeline.dataset_info import INFO_FILE, load_dataset_info
from input_pipeline.errors import DataError
from trainer.config import Config
from trainer.errors import ConfigError
from trainer.models import run_model

BYTE_VOCAB = 256  # the built-in corpora's byte-level tokenizer; the stand-in for a missing dataset


def dataset_path(config: Config) -> tuple[str, str]:
    """The run's (first) dataset and the config key naming it: a mixture's sources share one
    tokenizer, so the first one's vocabulary is every one's."""
    if config.data.mixture:
        return config.data.mixture[0].path, "data.mixture[0].path"
    return config.data.path, "data.path"


def dataset_vocab(config: Config) -> int | None:
    """The prepared dataset's vocabulary; None where the dataset is not here to read."""
    path, key = dataset_path(config)
    if path in BUILTIN_CORPORA:
        return BYTE_VOCAB
    if not (Path(path) / INFO_FILE).is_file():
        return None
    try:
        return load_dataset_info(path).vocab_size
    except DataError as err:
        raise ConfigError(
            f"{key}={path}: {err} (or set model.vocab_size to plan without it)"
        ) from None


def planned_vocab(config: Config) -> int:
    """`model.vocab_size`, else the dataset's, else the byte-level 256 (`missing_dataset_note`
    says so); a `model.vocab_size` below the dataset's is refused, as the trainer refuses it."""
    found = dataset_vocab(config)
    if config.model.vocab_size and found:
        run_model(config, None, found)  # the trainer's own check and message
    return config.model.vocab_size or found or BYTE_VOCAB


def missing_dataset_note(config: Config) -> str | None:
    """One line when the vocabulary is a stand-in: the plan's sizes then hold a byte-level
    embedding, output head and logits."""
    if config.model.vocab_size or dataset_vocab(config) is not None:
        return None
    path, key = dataset_path(config)
    return (
        f"model.vocab_size is unset and {key}={path} is not a prepared dataset here; planning "
        f"with a vocabulary of {BYTE_VOCAB}: set model.vocab_size to the tokenizer's"
    )
