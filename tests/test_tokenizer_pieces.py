"""SentencePiece encodes a long document in pieces cut at word starts: the same ids as encoding
it whole, without a Python int per token, which made the memory of `prepare --tokenizer
sentencepiece` grow with the largest `.txt` file (one document) many times over its size."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from input_pipeline.tokenizers import SentencePieceTokenizer, train_sentencepiece

WORDS = ["def", "return", "self", "the", "model", "déjà", "42", "x", "\n", "\t", "  ", "日本語"]


def text_of(words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, size=words))


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    lines = [text_of(30, seed) for seed in range(300)]
    return train_sentencepiece(lines, 300, tmp_path_factory.mktemp("sp") / "tokenizer.model")


TRICKY = [
    "  leading spaces, \ttabs\n\n  x  y   z " * 40,
    "ends with one space " * 30,
    " " * 500 + "a b" + " " * 5 + "c",
    "日本語のテキスト空白なし" * 100,
    "no-space-" * 200 + " then words after it " * 20,
]


@pytest.mark.parametrize("text", [text_of(2000, 1), text_of(5000, 2), *TRICKY])
@pytest.mark.parametrize("piece_chars", [1, 7, 64, 1000])
def test_pieces_encode_to_the_whole_texts_ids(model_file, text, piece_chars):
    tokenizer = SentencePieceTokenizer(model_file, threads=2)
    whole = np.asarray(tokenizer.processor.encode(text), dtype=np.int64)
    tokenizer._piece_chars = piece_chars
    assert tokenizer.encode(text).tolist() == whole.tolist()
    batch = tokenizer.encode_batch(["short one", text, "", text[:3]])
    assert [ids.tolist() for ids in batch] == [
        tokenizer.processor.encode(t) for t in ["short one", text, "", text[:3]]
    ]


PEAK_GROWTH = """
import json, resource, sys
import numpy as np
from input_pipeline.tokenizers import SentencePieceTokenizer
rng = np.random.default_rng(0)
words = np.array(["def", "return", "self", "the", "model", "42", "x", "\\n"])
text = (" ".join(rng.choice(words, size=10_000)) + " ") * 300  # built in little memory
tokenizer = SentencePieceTokenizer(sys.argv[1], threads=1)
tokenizer.encode("warm up")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = tokenizer.encode_batch([text])[0]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"tokens": len(ids), "growth_kb": after - before}))
"""


def test_a_long_document_costs_a_few_bytes_per_token_not_a_python_int(model_file, repo_root):
    """Encoded whole, the document's ids passed through a Python list of ints: the peak grew by
    tens of bytes per token; in pieces, by the int64 arrays and their concatenation at most."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK_GROWTH, str(model_file)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout)
    per_token = measured["growth_kb"] * 1024 / measured["tokens"]
    assert per_token < 25, measured


def test_a_model_with_other_normalization_is_encoded_whole(tmp_path):
    """Pieces are exact only for identity normalization (what prepare trains); a `.model` file
    trained with SentencePiece's defaults (NFKC, extra whitespace removed) is not cut."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    lines = iter([text_of(30, seed) for seed in range(300)])
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, vocab_size=30, minloglevel=2
    )
    (tmp_path / "nfkc.model").write_bytes(model.getvalue())
    tokenizer = SentencePieceTokenizer(tmp_path / "nfkc.model")
    assert tokenizer._piece_chars is None
