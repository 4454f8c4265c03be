"""Tokenizers a dataset can be prepared with; the choice is recorded in `dataset.json`."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from input_pipeline.errors import DataError


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...

    def spec(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train, never an unknown token."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)

    def decode(self, ids: np.ndarray) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")

    def spec(self) -> dict[str, Any]:
        return {"kind": self.name, "vocab_size": self.vocab_size}


def get_tokenizer(spec: dict[str, Any] | str) -> Tokenizer:
    """The tokenizer named by a CLI choice or by the `tokenizer` entry of dataset.json."""
    kind = spec if isinstance(spec, str) else spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    raise DataError(f"unknown tokenizer {kind!r}; this version supports: byte")
