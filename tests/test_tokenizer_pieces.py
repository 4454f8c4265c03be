"""SentencePiece encodes a long document in pieces cut at word starts: the same ids as encoding
it whole, without a Python int per token, which made the memory of `prepare --tokenizer
sentencepiece` grow with the largest `.txt` file (one document) many times over its size."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from input_pipeline.hf_pieces import CUTTING_REGEXES, HF_CUT, hf_cuts_exactly, hf_pieces
from input_pipeline.tokenizers import HFTokenizer, SentencePieceTokenizer, train_sentencepiece

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


# A Hugging Face tokenizer.json encodes a long document in pieces cut where its pre-tokenizer
# splits the same whatever lies past the cut: the same ids as whole, without the few hundred bytes
# per token the library holds while it encodes (a 1 GB one-document file needed hundreds of GB).
HF_TOKENIZER_JSON = Path(__file__).parent / "fixtures" / "hf_tiny_llama" / "tokenizer.json"
LLAMA3_SPLIT = {
    "type": "Sequence",
    "pretokenizers": [
        {
            "type": "Split",
            "pattern": {"Regex": CUTTING_REGEXES[1]},
            "behavior": "Isolated",
            "invert": False,
        },
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}
HF_TRICKY = [
    "a\n\nb\n\n\nc.\nd,\n e\r\nf \n g\n\t\nh\n  i\n\n j.\n\n\n  k\n \n l\n 5\n '6'\n",
    "word  word   word\tword \u00a0word x\u3000y",
    "café naïve e\u0301 \u0301x\n\u0301y ΣΑΣ ς İi 日本語 テキスト",
    "it's they'll I'M 12345 678 9x x9 a_b a-b (a) [b]\n'x\n's ½ Ⅻ 一 x. y, (z 5 w' v\" u",
    "<|begin_of_text|> x<|end_of_text|>\ny <|begin_of_text|>\n",
    "日本語のテキスト空白なし" * 40 + " then words\nand lines\n" * 5,
    " " * 300 + "a b" + "\n" * 5 + "c",
]


def hf_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [f.read_text(errors="replace")[:20_000] for f in sorted(stdlib.glob("*.py"))[:3]]
    return [*code, text_of(3000, 3), *HF_TRICKY]


def hf_tokenizer(tmp_path: Path, pre_tokenizer: dict | None = None, **changes) -> HFTokenizer:
    """The fixture's tokenizer.json, its pre-tokenizer or other settings replaced."""
    settings = json.loads(HF_TOKENIZER_JSON.read_text())
    if pre_tokenizer is not None:
        settings["pre_tokenizer"] = pre_tokenizer
    settings.update(changes)
    (tmp_path / "tokenizer.json").write_text(json.dumps(settings))
    return HFTokenizer(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("pre_tokenizer", [None, LLAMA3_SPLIT, {"type": "Whitespace"}])
def test_hf_pieces_encode_to_the_whole_texts_ids(tmp_path, pre_tokenizer):
    tokenizer = hf_tokenizer(tmp_path, pre_tokenizer)
    assert tokenizer.piece_chars is not None
    texts = hf_texts()
    whole = [e.ids for e in tokenizer._tok.encode_batch(texts)]
    assert whole[0][0] == 0  # the post-processor's BOS, put back once before the pieces
    for piece_chars in (1, 7, 300):
        tokenizer.piece_chars = piece_chars
        assert [ids.tolist() for ids in tokenizer.encode_batch(texts)] == whole, piece_chars


class RecordingTokenizer:
    """The `tokenizers` object, noting the longest text it was handed."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def encode_batch(self, texts, **kwargs):
        self.longest = max([self.longest, *map(len, texts)])
        return self.tok.encode_batch(texts, **kwargs)

    def encode(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tok.encode(text, **kwargs)


def test_the_library_is_handed_pieces_not_the_document(tmp_path):
    """Before: the whole document went to the library at once."""
    tokenizer = HFTokenizer(HF_TOKENIZER_JSON)
    text = hf_texts()[0] * 5
    whole = tokenizer.encode(text).tolist()
    tokenizer.piece_chars = 1000
    tokenizer._tok = RecordingTokenizer(tokenizer._tok)
    assert tokenizer.encode(text).tolist() == whole
    cuts = [cut.start() for cut in HF_CUT.finditer(text)]
    assert 1000 <= tokenizer._tok.longest <= 1000 + max(np.diff(cuts))


def test_hf_pieces_are_cut_past_the_size_at_the_first_cut():
    text = "".join(hf_texts())
    size = 500
    pieces = list(hf_pieces(text, size))
    assert "".join(pieces) == text
    for piece in pieces[:-1]:
        assert len(piece) >= size
        assert HF_CUT.search(piece, size) is None  # no earlier cut was passed over
    no_cut = "日本語" * 1000  # one pre-token: a stretch no cut can split stays whole
    assert list(hf_pieces(no_cut + " a b", 1)) == [no_cut, " a", " b"]


@pytest.mark.parametrize(
    "change",
    [
        {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}},
        {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}},
        {"pre_tokenizer": None},
        {"normalizer": {"type": "Prepend", "prepend": "▁"}},
    ],
)
def test_an_hf_tokenizer_not_known_to_cut_exactly_is_encoded_whole(tmp_path, change):
    settings = json.loads(HF_TOKENIZER_JSON.read_text())
    assert hf_cuts_exactly(settings)
    assert not hf_cuts_exactly({**settings, **change})


@pytest.mark.parametrize("added", [{"rstrip": True}, {"lstrip": True}, {"content": "a b"}])
def test_an_added_token_that_could_match_across_a_cut_is_encoded_whole(tmp_path, added):
    """An rstrip token took the space a cut left to the next piece: "a <|end_of_text|> b c"
    gave id 267 (" b") where the whole text has 67 ("b")."""
    settings = json.loads(HF_TOKENIZER_JSON.read_text())
    tokens = [settings["added_tokens"][0], {**settings["added_tokens"][1], **added}]
    tokenizer = hf_tokenizer(tmp_path, added_tokens=tokens)
    assert tokenizer.piece_chars is None
    text = "a <|end_of_text|> b c a\n<|end_of_text|>x a b"
    whole = tokenizer._tok.encode(text).ids
    assert tokenizer.encode(text).tolist() == whole
