"""Tokenizers a dataset can be prepared with; the choice is recorded in `dataset.json`.

`byte` needs nothing. `sentencepiece` is trained offline on the input text (or an existing
`.model` file is used) and its model file is stored beside the shards, so the dataset folder
alone is enough to decode what a model generates. `hf:PATH` copies a Hugging Face folder's
`tokenizer.json` the same way and runs it with the `tokenizers` library, offline; a folder whose
`tokenizer_config.json` says otherwise about the BOS is refused, as transformers versions differ
on which file wins.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from input_pipeline.documents import nonblank_lines
from input_pipeline.errors import DataError
from input_pipeline.hf_pieces import hf_cuts_exactly, hf_pieces, special_ends

SENTENCEPIECE_FILE = "tokenizer.model"
HF_TOKENIZER_FILE = "tokenizer.json"  # `--tokenizer hf:PATH`: a Hugging Face model folder's
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_PREFIX = "hf:"
# Byte fallback needs 256 byte pieces plus <unk>, <s>, </s>; fewer leaves no room for merges.
MIN_SENTENCEPIECE_VOCAB = 260
# Lines sampled for training (`--tokenizer-sample-sentences`): enough for a good vocabulary,
# bounded memory and time on any corpus.
TRAINING_SENTENCES = 1_000_000
# A longer text is encoded by SentencePiece in pieces of about this many characters: encoding it
# whole builds a Python int per token, tens of bytes each, before any numpy array.
ENCODE_PIECE_CHARS = 1 << 20
WORD_START_SPACE = re.compile(r"(?<=[^ ]) (?=[\s\S])")  # after a non-space, before something
# A longer text is encoded by a Hugging Face tokenizer in pieces of about this many characters,
# this many pieces a call: the library holds a few hundred bytes per token while it encodes.
HF_PIECE_CHARS = 1 << 16
HF_PIECES_PER_CALL = 8


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
    """A SentencePiece model; batches are encoded on every core by SentencePiece's own threads.
    `processor` is the loaded model, for what else reads its settings (the Hugging Face export)."""

    name = "sentencepiece"

    def __init__(self, model_file: str | Path, threads: int | None = None):
        import sentencepiece as spm

        self.model_file = Path(model_file)
        try:
            self.processor = spm.SentencePieceProcessor(model_file=str(self.model_file))
        except (OSError, RuntimeError) as err:
            raise DataError(
                f"{self.model_file} is not a readable SentencePiece model ({err}); pass a .model "
                "file written by SentencePiece, or --tokenizer sentencepiece to train one"
            ) from None
        self.vocab_size = int(self.processor.vocab_size())
        self._threads = threads or os.cpu_count() or 1  # fewer per process in a pool
        self._piece_chars = ENCODE_PIECE_CHARS if cuts_at_word_starts(self.processor) else None

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        limit = self._piece_chars
        short = [text for text in texts if limit is None or len(text) <= limit]
        ids = iter(self.processor.encode(short, num_threads=self._threads) if short else [])
        return [
            np.asarray(next(ids), dtype=np.int64)
            if limit is None or len(text) <= limit
            else self._encode_in_pieces(text, limit)
            for text in texts
        ]

    def _encode_in_pieces(self, text: str, size: int) -> np.ndarray:
        """The ids of a long `text`, equal to encoding it whole, with memory bounded by a batch
        of pieces rather than by the text."""
        pieces = word_start_pieces(text, size)
        batch = max(1, self._threads)
        arrays = [
            np.asarray(row, dtype=np.int64)
            for start in range(0, len(pieces), batch)
            for row in self.processor.encode(
                pieces[start : start + batch], num_threads=self._threads
            )
        ]
        return np.concatenate(arrays)

    def decode(self, ids: np.ndarray) -> str:
        return self.processor.decode(np.asarray(ids).tolist())

    def spec(self) -> dict[str, Any]:
        return model_file_spec(self.name, self.vocab_size, self.model_file)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` run by the `tokenizers` library (fully offline); special
    tokens its post-processor adds (a Llama BOS) are kept, as `transformers` adds them. A long
    text is encoded in pieces where the tokenizer's own splitting cuts it (`hf_cuts_exactly`),
    so memory follows the piece size, not the largest document."""

    name = "hf"

    def __init__(self, tokenizer_file: str | Path, piece_chars: int = HF_PIECE_CHARS):
        from tokenizers import Tokenizer as RustTokenizer

        self.model_file = Path(tokenizer_file)
        try:
            text = self.model_file.read_text(encoding="utf-8")  # once: the library and our checks
            self._tok, settings = RustTokenizer.from_str(text), json.loads(text)
        except Exception as err:  # the library raises its own untyped exceptions
            raise DataError(
                f"{self.model_file} is not a readable Hugging Face tokenizer.json ({err})"
            ) from None
        self._tok.no_truncation()  # a tokenizer.json saved after a call with max_length keeps it:
        self._tok.no_padding()  # transformers applies neither unless a call asks, nor does prepare
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.config = hf_config(self.model_file.with_name(HF_TOKENIZER_CONFIG))
        self.ends = special_ends(self._tok)  # the ids its post-processor puts around a text
        self.bos_id, self.eos_id = self._special_id("bos_token"), self._special_id("eos_token")
        if "bos_token" not in self.config and self.ends is not None and len(self.ends[0]) == 1:
            self.bos_id = self.ends[0][0]  # no config to name it: the one id before every text
        cuts = self.ends is not None and hf_cuts_exactly(settings)
        self.piece_chars = piece_chars if cuts else None

    def special_token(self, role: str) -> str | None:
        """A token tokenizer_config.json names (`bos_token`, `eos_token`), if any."""
        token = self.config.get(role)
        return token.get("content") if isinstance(token, dict) else token

    def _special_id(self, role: str) -> int | None:
        token = self.special_token(role)
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        limit = self.piece_chars
        short = [text for text in texts if limit is None or len(text) <= limit]
        encoded = iter(self._tok.encode_batch(short) if short else [])
        return [
            np.asarray(next(encoded).ids, dtype=np.int64)
            if limit is None or len(text) <= limit
            else self._encode_in_pieces(text, limit)
            for text in texts
        ]

    def _encode_in_pieces(self, text: str, size: int) -> np.ndarray:
        """The ids of a long `text`, equal to encoding it whole: its pieces' ids between the
        special tokens the post-processor puts around a text."""
        assert self.ends is not None
        before, after = self.ends
        arrays = [np.asarray(before, dtype=np.uint32)]
        pieces = hf_pieces(text, size)
        while batch := list(itertools.islice(pieces, HF_PIECES_PER_CALL)):
            encoded = self._tok.encode_batch(batch, add_special_tokens=False)
            arrays += [np.asarray(e.ids, dtype=np.uint32) for e in encoded]  # the library's type
        return np.concatenate([*arrays, np.asarray(after, dtype=np.uint32)], dtype=np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return self._tok.decode(np.asarray(ids).tolist(), skip_special_tokens=True)

    def spec(self) -> dict[str, Any]:
        return model_file_spec(self.name, self.vocab_size, self.model_file)


def hf_config(config_file: Path) -> dict[str, Any]:
    """The settings of the tokenizer_config.json beside a tokenizer.json ({} without one)."""
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{config_file} is not valid JSON ({err}); fix or remove it") from None
    if not isinstance(config, dict):
        raise DataError(f"{config_file} is not a JSON object; fix or remove it")
    return config


def bos_disagreement(tokenizer: HFTokenizer) -> str | None:
    """How a folder's tokenizer_config.json contradicts the BOS its tokenizer.json puts before
    a text (None: they agree, or the config is silent). transformers does not settle it alike:
    4.x's LlamaTokenizerFast rebuilds the post-processor from the config, its
    PreTrainedTokenizerFast and 5.x keep tokenizer.json's and report the config's bos_token."""
    if tokenizer.ends is None:
        return None
    first = tokenizer.ends[0][:1]
    added = tokenizer._tok.id_to_token(first[0]) if first else None
    add_bos, named = tokenizer.config.get("add_bos_token"), tokenizer.special_token("bos_token")
    puts = f"{HF_TOKENIZER_FILE} puts {added} before every text, but {HF_TOKENIZER_CONFIG}"
    which = (
        "(transformers 4's LlamaTokenizerFast follows the config, its PreTrainedTokenizerFast "
        "and transformers 5 the tokenizer.json)"
    )
    post_processor = f"{HF_TOKENIZER_FILE}'s post_processor"
    if add_bos is False and added:
        return (
            f"{puts} says add_bos_token=false {which}; make them agree: set add_bos_token to "
            f"true, or take {added} out of {post_processor}"
        )
    if add_bos is True and not added:
        return (
            f"{HF_TOKENIZER_FILE} puts no BOS before a text, but {HF_TOKENIZER_CONFIG} says "
            f"add_bos_token=true {which}; make them agree: set add_bos_token to false, or put "
            f"{named or 'the BOS'} first in {post_processor}"
        )
    if added and named is not None and named != added:
        return (
            f"{puts} names {named} as bos_token (transformers adds the one and reports the "
            f"other as the BOS id); make them agree: set bos_token to {added}, or put {named} "
            f"first in {post_processor}"
        )
    return None


def unknown_special_token(tokenizer: HFTokenizer) -> str | None:
    """A bos_token or eos_token of tokenizer_config.json that tokenizer.json's vocabulary lacks
    (None: none). It has no id for an export to report, and transformers adds it past the
    vocabulary, where the model has no embedding row."""
    for role in ("bos_token", "eos_token"):
        token = tokenizer.special_token(role)
        if token is not None and tokenizer._tok.token_to_id(token) is None:
            return (
                f"{HF_TOKENIZER_CONFIG} names {token} as {role}, which is not in "
                f"{HF_TOKENIZER_FILE}'s vocabulary; set {role} to one of its tokens, or remove it"
            )
    return None


def model_proto(processor: Any) -> Any | None:
    """A SentencePiece model's settings (its `normalizer_spec`, `trainer_spec`), or None when
    they cannot be read: no protobuf, or one its generated code does not suit."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except (ImportError, TypeError):
        return None
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(processor.serialized_model_proto())
    return model


def cuts_at_word_starts(processor: Any) -> bool:
    """Whether `word_start_pieces` encode exactly as the whole text with this SentencePiece
    model: identity normalization that keeps every space (as `train_sentencepiece` writes), words
    split at spaces, and a dummy prefix standing in for the space a piece leaves out."""
    model = model_proto(processor)
    if model is None:
        return False  # then encode whole, as before
    normalizer, trainer = model.normalizer_spec, model.trainer_spec
    return (
        normalizer.name == "identity"
        and not normalizer.remove_extra_whitespaces
        and normalizer.add_dummy_prefix
        and trainer.split_by_whitespace
        and not trainer.treat_whitespace_as_suffix
    )


def word_start_pieces(text: str, size: int) -> list[str]:
    """`text` cut into pieces of about `size` characters, each cut at a space that begins a word
    (after a non-space, and not the text's last character); the space itself is left out, since
    SentencePiece's dummy prefix puts it back, so the pieces' ids concatenate to the whole
    text's. Text without such a space stays one piece."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = WORD_START_SPACE.search(text, start + size)
        if cut is None:
            break
        pieces.append(text[start : cut.start()])
        start = cut.end()
    pieces.append(text[start:])
    return pieces


def train_sentencepiece(
    documents: Iterable[str],
    vocab_size: int,
    model_file: Path,
    sample_sentences: int = TRAINING_SENTENCES,
) -> Path:
    """Train a lossless BPE model (identity normalization, byte fallback, whitespace kept), as
    modern decoder LMs use, on the first `sample_sentences` non-blank lines of `documents` (a
    caller passes a sample of its corpus), and write it to `model_file`."""
    import sentencepiece as spm

    if vocab_size < MIN_SENTENCEPIECE_VOCAB:
        raise DataError(
            f"--vocab-size={vocab_size} is too small for SentencePiece with byte fallback; use at "
            f"least {MIN_SENTENCEPIECE_VOCAB} (or --tokenizer byte)"
        )
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=nonblank_lines(documents, sample_sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            character_coverage=0.9995,
            input_sentence_size=sample_sentences,
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
    choice: str,
    folder: Path,
    documents: Iterable[str] = (),
    vocab_size: int | None = None,
    sample_sentences: int = TRAINING_SENTENCES,
) -> Tokenizer:
    """The tokenizer a `prepare` run asked for (`byte`, `sentencepiece`, a `.model` path, or
    `hf:PATH`); its model file is trained or copied into `folder`, which holds the new dataset."""
    if choice == "byte":
        return ByteTokenizer()
    if choice.startswith(HF_PREFIX):  # tokenizer.json, and tokenizer_config.json if there
        source = Path(choice[len(HF_PREFIX) :])
        if not (source / HF_TOKENIZER_FILE).is_file():
            raise DataError(f"--tokenizer hf:{source}: no {HF_TOKENIZER_FILE} in that folder")
        given = HFTokenizer(source / HF_TOKENIZER_FILE)
        if reason := unknown_special_token(given) or bos_disagreement(given):
            raise DataError(f"--tokenizer hf:{source}: {reason}")
        for name in (HF_TOKENIZER_FILE, HF_TOKENIZER_CONFIG):
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
        return HFTokenizer(folder / HF_TOKENIZER_FILE)
    target = folder / SENTENCEPIECE_FILE
    if choice == "sentencepiece":
        if not vocab_size:
            raise DataError("--tokenizer sentencepiece needs --vocab-size N (e.g. 32000)")
        return SentencePieceTokenizer(
            train_sentencepiece(documents, vocab_size, target, sample_sentences)
        )
    if choice.endswith(".model"):
        if not Path(choice).is_file():
            raise DataError(f"--tokenizer {choice}: no such SentencePiece model file")
        shutil.copyfile(choice, target)
        return SentencePieceTokenizer(target)
    raise DataError(
        f"--tokenizer {choice!r} is unknown; use byte, sentencepiece, a path to a .model file, "
        "or hf:PATH (a Hugging Face model folder)"
    )


def get_tokenizer(spec: dict[str, Any], folder: str | Path) -> Tokenizer:
    """The tokenizer named by the `tokenizer` entry of a dataset folder's dataset.json."""
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    default_file = {"sentencepiece": SENTENCEPIECE_FILE, HFTokenizer.name: HF_TOKENIZER_FILE}
    if kind in default_file:  # the "model" prepare records is always the kind's default name
        return tokenizer_from_file(Path(folder) / spec.get("model", default_file[kind]))
    raise DataError(f"unknown tokenizer {kind!r}; this version supports byte, sentencepiece and hf")


def tokenizer_from_file(model_file: str | Path, threads: int | None = None) -> Tokenizer:
    """The tokenizer a model file holds, told by its name: a Hugging Face `tokenizer.json`, else
    a SentencePiece model (`threads`: its encoding threads)."""
    if Path(model_file).name == HF_TOKENIZER_FILE:
        return HFTokenizer(model_file)
    return SentencePieceTokenizer(model_file, threads=threads)


def model_file_spec(kind: str, vocab_size: int, model_file: Path) -> dict[str, Any]:
    """What `dataset.json` records of a tokenizer kept as a file: the file's name and hash."""
    return {
        "kind": kind,
        "vocab_size": vocab_size,
        "model": model_file.name,
        "sha256": hashlib.sha256(model_file.read_bytes()).hexdigest(),
    }
