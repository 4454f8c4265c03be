"""prepare's inputs and tokenizers, and the checks a prepared dataset gets when a run loads it:
parquet and jsonl give the same tokens, SentencePiece is trained (or reused) and stored with the
data, shards are verified against their checksums, and skipped corrupt records are counted."""

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import TINY

from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.pipeline import make_batch_iterator
from input_pipeline.prepare import main as prepare_main
from input_pipeline.prepare import prepare_dataset
from input_pipeline.reading import Reading
from input_pipeline.records import token_dtype
from input_pipeline.tokenizers import SENTENCEPIECE_FILE, get_tokenizer
from trainer.config import load_config
from trainer.data import load_dataset
from trainer.train import run


def texts(n=80, seed=1):
    rng = np.random.default_rng(seed)
    words = ["the", "model", "never", "waits", "for", "data", "tokens", "déjà", "vu", "\t", "42"]
    return [
        f"Document {i}.\n" + " ".join(rng.choice(words, size=int(rng.integers(5, 300))))
        for i in range(n)
    ]


def all_tokens(folder, split="train"):
    """Every record of a split, in order (no shuffle, no packing)."""
    info = load_dataset_info(folder)
    it = make_batch_iterator(
        info, split, seq_len=64, batch_size=1, reading=Reading(shuffle=False, num_epochs=1)
    )
    return np.concatenate([b["inputs"][b["weights"] > 0] for b in it])


def run_prepare(*args):
    return prepare_main([*map(str, args), "--eval-fraction", "0.1"])


def test_parquet_and_jsonl_give_the_same_dataset(tmp_path, capsys):
    docs = texts()
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in docs)
    pq.write_table(pa.table({"id": range(len(docs)), "body": docs}), tmp_path / "docs.parquet")

    assert (
        run_prepare(
            "--input", tmp_path / "*.jsonl", "--output", tmp_path / "j", "--text-field", "body"
        )
        == 0
    )
    assert (
        run_prepare(
            "--input", tmp_path / "*.parquet", "--output", tmp_path / "p", "--text-field", "body"
        )
        == 0
    )
    a = json.loads((tmp_path / "j" / "dataset.json").read_text())
    b = json.loads((tmp_path / "p" / "dataset.json").read_text())
    assert a["splits"] == b["splits"]  # same documents, split, shards and checksums
    assert a["splits"]["train"]["documents"] + a["splits"]["eval"]["documents"] == len(docs)

    assert run_prepare("--input", tmp_path / "*.parquet", "--output", tmp_path / "x") == 2
    assert "has no column 'text' (columns: id, body)" in capsys.readouterr().err


def test_sentencepiece_is_trained_stored_and_reused(tmp_path):
    docs = texts()
    trained = prepare_dataset(
        docs, tmp_path / "sp", tokenizer="sentencepiece", vocab_size=320, progress=False
    )
    info = load_dataset_info(trained)
    assert info.tokenizer["kind"] == "sentencepiece" and info.vocab_size == 320
    assert info.token_dtype == "<u2"
    assert (trained / SENTENCEPIECE_FILE).is_file()
    tok = get_tokenizer(info.tokenizer, trained)
    for doc in docs[:10]:  # identity normalization + byte fallback: nothing is lost
        assert tok.decode(tok.encode(doc)) == doc
    assert len(tok.encode(docs[0])) < len(docs[0].encode()) / 2  # it learned merges

    # An existing .model file: copied into the new dataset, same tokens for the same text.
    reused = prepare_dataset(
        docs, tmp_path / "reuse", tokenizer=str(trained / SENTENCEPIECE_FILE), progress=False
    )
    assert (reused / SENTENCEPIECE_FILE).read_bytes() == (trained / SENTENCEPIECE_FILE).read_bytes()
    np.testing.assert_array_equal(all_tokens(trained), all_tokens(reused))


@pytest.mark.parametrize(
    ("tokenizer", "vocab", "message"),
    [
        ("sentencepiece", None, "needs --vocab-size"),
        ("sentencepiece", 100, "too small"),
        ("sentencepiece", 60000, "lower --vocab-size"),
        ("missing.model", None, "no such SentencePiece model"),
        ("wordpiece", None, "unknown"),
    ],
)
def test_bad_tokenizer_choices_name_the_fix(tmp_path, tokenizer, vocab, message):
    with pytest.raises(DataError, match=message):
        prepare_dataset(
            texts(20), tmp_path / "out", tokenizer=tokenizer, vocab_size=vocab, progress=False
        )
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left behind


@pytest.fixture
def damaged(corpus, tmp_path):
    """A copy of the shared corpus with bytes of one train shard flipped."""
    copy = tmp_path / "damaged"
    shutil.copytree(corpus, copy)
    shard = sorted(copy.glob("train-00000-*"))[0]
    data = bytearray(shard.read_bytes())
    for i in range(200, len(data) // 2):
        data[i] ^= 0x5A
    shard.write_bytes(bytes(data))
    return copy, shard


def test_checksum_mismatch_is_caught_when_a_run_loads_the_data(damaged):
    copy, shard = damaged
    config = load_config(None, [f"data.path={copy}"])
    with pytest.raises(DataError, match=rf"{shard.name} does not match the checksum"):
        load_dataset(config.data)
    load_dataset(load_config(None, [f"data.path={copy}", "data.verify_checksums=false"]).data)


@pytest.mark.slow
def test_skip_corrupt_trains_and_counts_the_skipped_records(damaged, tmp_path):
    copy, _ = damaged
    workdir = tmp_path / "run"
    config = load_config(
        None,
        [
            *TINY,
            f"data.path={copy}",
            f"run.workdir={workdir}",
            "run.steps=6",
            "data.skip_corrupt=true",
            "checkpoint.every=100",
            "eval.every=100",
        ],
    )
    result = run(config)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    counts = [r["corrupt_records_skipped"] for r in rows if "corrupt_records_skipped" in r]
    assert counts and counts[-1] > 0 and counts == sorted(counts)
    assert np.isfinite(result.last_metrics["loss"])


@pytest.mark.parametrize(
    "vocab, stored",
    [(256, "|u1"), (257, "<u2"), (2**16, "<u2"), (2**16 + 1, "<u4"), (152_064, "<u4")],
)
def test_tokens_are_stored_in_the_narrowest_type_the_vocabulary_fits(vocab, stored):
    assert token_dtype(vocab).str == stored
