"""Tokenizers a dataset can be prepared with; the choice is recorded in `dataset.json`.

`byte` needs nothing. `sentencepiece` is trained offline on the input text (or an existing
`.model` file is used) and its model file is stored beside the shards, so the dataset folder
alone is enough to decode what a model generates.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from input_pipeline.errors import DataError

SENTENCEPIECE_FILE = "tokenizer.model"
# Byte fallback needs 256 byte pieces plus <unk>, <s>, </s>; fewer leaves no room for merges.
MIN_SENTENCEPIECE_VOCAB = 260
# Lines sampled for training: enough for a good vocabulary, bounded memory on any corpus.
TRAINING_SENTENCES = 2_000_000


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: np.ndarray) -> str: ...

    def spec(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train, never an unknown token."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]  # a memcpy each: no pool is worth it

    def decode(self, ids: np.ndarray) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")

    def spec(self) -> dict[str, Any]:
        return {"kind": self.name, "vocab_size": self.vocab_size}


class SentencePieceTokenizer:
    """A SentencePiece model; batches are encoded on every core by SentencePiece's own threads."""

    name = "sentencepiece"

    def __init__(self, model_file: str | Path):
        import sentencepiece as spm

        self.model_file = Path(model_file)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.model_file))
        except (OSError, RuntimeError) as err:
            raise DataError(
                f"{self.model_file} is not a readable SentencePiece model ({err}); pass a .model "
                "file written by SentencePiece, or --tokenizer sentencepiece to train one"
            ) from None
        self.vocab_size = int(self._sp.vocab_size())
        self._threads = os.cpu_count() or 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ids = self._sp.encode(texts, num_threads=self._threads)
        return [np.asarray(row, dtype=np.int64) for row in ids]

    def decode(self, ids: np.ndarray) -> str:
        return self._sp.decode(np.asarray(ids).tolist())

    def spec(self) -> dict[str, Any]:
        return {
            "kind": self.name,
            "vocab_size": self.vocab_size,
            "model": self.model_file.name,
            "sha256": hashlib.sha256(self.model_file.read_bytes()).hexdigest(),
        }


def _training_lines(documents: Iterable[str]) -> Iterator[str]:
    """SentencePiece learns from lines; blank lines carry nothing to learn."""
    for document in documents:
        for line in document.splitlines():
            if line.strip():
                yield line


def train_sentencepiece(documents: Iterable[str], vocab_size: int, model_file: Path) -> Path:
    """Train a lossless BPE model (identity normalization, byte fallback, whitespace kept), as
    modern decoder LMs use, and write it to `model_file`."""
    import sentencepiece as spm

    if vocab_size < MIN_SENTENCEPIECE_VOCAB:
        raise DataError(
            f"--vocab-size={vocab_size} is too small for SentencePiece with byte fallback; use at "
            f"least {MIN_SENTENCEPIECE_VOCAB} (or --tokenizer byte)"
        )
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(documents),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            character_coverage=0.9995,
            input_sentence_size=TRAINING_SENTENCES,
            shuffle_input_sentence=True,
            max_sentence_length=1 << 16,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as err:
        reason = str(err).splitlines()[-1] if str(err) else "training failed"
        raise DataError(
            f"SentencePiece training failed ({reason}); with little text, lower --vocab-size"
        ) from None
    model_file.write_bytes(model.getvalue())
    return model_file


def make_tokenizer(
    choice: str, folder: Path, documents: Iterable[str] = (), vocab_size: int | None = None
) -> Tokenizer:
    """The tokenizer a `prepare` run asked for (`byte`, `sentencepiece`, or a `.model` path);
    a SentencePiece model is trained or copied into `folder`, which holds the new dataset."""
    if choice == "byte":
        return ByteTokenizer()
    target = folder / SENTENCEPIECE_FILE
    if choice == "sentencepiece":
        if not vocab_size:
            raise DataError("--tokenizer sentencepiece needs --vocab-size N (e.g. 32000)")
        return SentencePieceTokenizer(train_sentencepiece(documents, vocab_size, target))
    if choice.endswith(".model"):
        if not Path(choice).is_file():
            raise DataError(f"--tokenizer {choice}: no such SentencePiece model file")
        shutil.copyfile(choice, target)
        return SentencePieceTokenizer(target)
    raise DataError(
        f"--tokenizer {choice!r} is unknown; use byte, sentencepiece, or a path to a .model file"
    )


def get_tokenizer(spec: dict[str, Any] | str, folder: str | Path | None = None) -> Tokenizer:
    """The tokenizer named by the `tokenizer` entry of a dataset folder's dataset.json."""
    kind = spec if isinstance(spec, str) else spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "sentencepiece" and isinstance(spec, dict) and folder is not None:
        return SentencePieceTokenizer(Path(folder) / spec.get("model", SENTENCEPIECE_FILE))
    raise DataError(f"unknown tokenizer {kind!r}; this version supports byte and sentencepiece")
