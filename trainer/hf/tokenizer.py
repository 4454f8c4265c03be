"""Tokenizers between this project and Hugging Face folders.

A folder a run starts from must tokenize as its training data did: its embedding rows belong to
its own `tokenizer.json`, and ids of another tokenizer train silently. A folder `trainer.export
--format hf` writes must make `transformers.AutoTokenizer` give exactly the ids `prepare` wrote:
its defaults for a bare `tokenizer.model` (transformers 4.x's LlamaTokenizerFast adds a BOS the
data never had) and for a bare `tokenizer.json` are not what the data had, so the export states
the settings in a `tokenizer_config.json`, and gives byte-level data a `tokenizer.json` too.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from input_pipeline.tokenizers import (
    HF_TOKENIZER_CONFIG,
    HF_TOKENIZER_FILE,
    SENTENCEPIECE_FILE,
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    model_proto,
)
from trainer.hf import hf_folder

# transformers' own tokenizer class for a bare tokenizer.json, in 4.x and 5.x alike.
FAST_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# Characters the byte-level pre-tokenizer (GPT-2's) keeps as themselves; every other byte maps to
# a character past 255, in byte order.
PRINTABLE_BYTES = (
    *range(ord("!"), ord("~") + 1),
    *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
    *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
)
# A SentencePiece normalizer transformers 4.x's LlamaTokenizerFast reproduces: it converts every
# tokenizer.model as Llama's (no normalization, a dummy prefix, spaces kept).
LLAMA_NORMALIZER = {
    "name": "identity",
    "add_dummy_prefix": True,
    "remove_extra_whitespaces": False,
}


def other_tokenizer_warning(init_from: str | None, data_tokenizer: Tokenizer | None) -> str | None:
    """One line when `checkpoint.init_from=hf:F` brings a `tokenizer.json` the training data was
    not tokenized with (byte-identical); None when they match or either is unknown."""
    folder = hf_folder(init_from)
    if folder is None or data_tokenizer is None:
        return None
    theirs = Path(folder) / HF_TOKENIZER_FILE
    if not theirs.is_file():
        return None
    if same_tokenizer(data_tokenizer, theirs):
        return None
    return (
        f"warning: checkpoint.init_from=hf:{folder} comes with its own {HF_TOKENIZER_FILE}, but "
        f"the training data was tokenized with another ({data_tokenizer.name}): the model reads "
        f"its ids as other tokens; prepare the data with --tokenizer hf:{folder}"
    )


def same_tokenizer(data_tokenizer: Tokenizer, tokenizer_json: Path) -> bool:
    """Whether a folder's `tokenizer.json` is the data's own: the same file, or for byte-level
    data the one `trainer.export --format hf` writes for it."""
    if isinstance(data_tokenizer, ByteTokenizer):
        try:
            return json.loads(tokenizer_json.read_text()) == byte_tokenizer_json()
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return False
    ours = getattr(data_tokenizer, "model_file", None)
    return ours is not None and Path(ours).read_bytes() == tokenizer_json.read_bytes()


def write_tokenizer(tokenizer: Tokenizer | None, out: Path, context: int) -> dict[str, Any]:
    """Write into `out` the tokenizer files with which `transformers.AutoTokenizer` encodes text
    to the ids the training data has (`context`: its `model_max_length`); returns config.json's
    `bos_token_id` and `eos_token_id` (None: the data has no such token), or {} when the
    dataset's tokenizer is unknown."""
    if isinstance(tokenizer, ByteTokenizer):
        return write_byte_tokenizer(out, context)
    if isinstance(tokenizer, SentencePieceTokenizer):
        return write_sentencepiece_tokenizer(tokenizer, out, context)
    if isinstance(tokenizer, HFTokenizer):
        return write_hf_tokenizer(tokenizer, out, context)
    print(
        "warning: no tokenizer written: the run's dataset folder is gone; copy its tokenizer "
        "files into the exported folder",
        file=sys.stderr,
    )
    return {}


def write_byte_tokenizer(out: Path, context: int) -> dict[str, Any]:
    """Byte-level data: a `tokenizer.json` whose ids are the UTF-8 bytes, no special tokens."""
    _write_json(out / HF_TOKENIZER_FILE, byte_tokenizer_json())
    settings = {
        "tokenizer_class": FAST_TOKENIZER_CLASS,
        "bos_token": None,
        "eos_token": None,
        "unk_token": None,
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
    }
    _write_json(out / HF_TOKENIZER_CONFIG, settings)
    return {"bos_token_id": None, "eos_token_id": None}


def byte_tokenizer_json() -> dict[str, Any]:
    """A `tokenizers` file that encodes as `ByteTokenizer`: the byte-level pre-tokenizer maps
    each byte to one character, and a BPE without merges maps that character to the byte's
    value; decoding maps back to bytes and replaces invalid UTF-8 as `ByteTokenizer` does."""
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    vocab = {char: byte for byte, char in enumerate(byte_level_alphabet())}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def byte_level_alphabet() -> list[str]:
    """The character the byte-level pre-tokenizer writes for each byte, in byte order."""
    chars, shifted = [], 0
    for byte in range(256):
        if byte in PRINTABLE_BYTES:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def write_sentencepiece_tokenizer(
    tokenizer: SentencePieceTokenizer, out: Path, context: int
) -> dict[str, Any]:
    """SentencePiece data: the `tokenizer.model`, and settings that keep transformers from adding
    a BOS or EOS (prepare added none) and from reading `<s>` typed in a text as the BOS token
    (SentencePiece encodes it as text)."""
    shutil.copyfile(tokenizer.model_file, out / SENTENCEPIECE_FILE)
    processor = tokenizer.processor
    ids = {
        role: processor.id_to_piece(index) if 0 <= index < processor.vocab_size() else None
        for role, index in (
            ("bos", processor.bos_id()),
            ("eos", processor.eos_id()),
            ("unk", processor.unk_id()),
            ("pad", processor.pad_id()),
        )
    }
    settings = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": ids["bos"],
        "eos_token": ids["eos"],
        "unk_token": ids["unk"],
        "pad_token": ids["pad"],
        "split_special_tokens": True,
        "legacy": True,  # transformers 4.x's default, stated: it warns when it is left unset
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
    }
    _write_json(out / HF_TOKENIZER_CONFIG, settings)
    if reason := unlike_llama(processor):
        print(
            f"warning: {tokenizer.model_file.name} {reason}; transformers 5 tokenizes it as the "
            "training data was, transformers 4's LlamaTokenizerFast (which converts it as "
            "Llama's) does not",
            file=sys.stderr,
        )
    return {
        "bos_token_id": _known(processor.bos_id()),
        "eos_token_id": _known(processor.eos_id()),
    }


def unlike_llama(processor: Any) -> str | None:
    """How a SentencePiece model normalizes text unlike Llama's (None: as Llama's, or unknown:
    the model proto cannot be read without protobuf)."""
    model = model_proto(processor)
    if model is None:
        return None
    differs = [
        f"{key}={getattr(model.normalizer_spec, key)}"
        for key, llama in LLAMA_NORMALIZER.items()
        if getattr(model.normalizer_spec, key) != llama
    ]
    return f"normalizes text unlike Llama's ({', '.join(differs)})" if differs else None


def write_hf_tokenizer(tokenizer: HFTokenizer, out: Path, context: int) -> dict[str, Any]:
    """`hf:PATH` data: the `tokenizer.json` and the folder's `tokenizer_config.json`; without
    one, a config that keeps transformers from building a LlamaTokenizerFast with its own BOS
    around the file (the file's post-processor already adds what the data has)."""
    source = tokenizer.model_file
    shutil.copyfile(source, out / HF_TOKENIZER_FILE)
    if source.with_name(HF_TOKENIZER_CONFIG).is_file():
        shutil.copyfile(source.with_name(HF_TOKENIZER_CONFIG), out / HF_TOKENIZER_CONFIG)
    else:
        settings = {
            "tokenizer_class": FAST_TOKENIZER_CLASS,
            "clean_up_tokenization_spaces": False,
            "model_max_length": context,
        }
        _write_json(out / HF_TOKENIZER_CONFIG, settings)
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}


def _known(index: int) -> int | None:
    """A SentencePiece special id, None for the -1 of a model without that token."""
    return index if index >= 0 else None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
