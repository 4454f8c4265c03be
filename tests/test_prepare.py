"""prepare's inputs and tokenizers, and the checks a prepared dataset gets when a run loads it:
parquet and jsonl give the same tokens, SentencePiece is trained (or reused) and stored with the
data, shards are verified against their checksums, and skipped corrupt records are counted."""

import json

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
from input_pipeline.shard_groups import is_eval_document
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


BAD_INPUTS = {  # an input prepare cannot read as meant -> what its one-line error must say
    "sub": "matches no file (only the folders",
    "latin1.txt": "latin1.txt is not UTF-8 text (byte 3); convert it",
    "binary.txt": "binary.txt is not UTF-8 text (byte 128)",
    "latin1.jsonl": "latin1.jsonl line 2 is not UTF-8 text (byte 28)",
    "number.jsonl": "line 2 (byte 15): field 'text' holds int, not text; name the text field",
    "null.jsonl": "no training documents (1 skipped for a null text) for",
    "list.jsonl": "line 2 (byte 15): field 'text' holds list, not text",
    "object.jsonl": "line 2 (byte 15): field 'text' holds dict, not text",
    "broken.jsonl": "broken.jsonl line 2 (byte 15) is not valid JSON (",
    "surrogate.jsonl": "line 2 (byte 15): field 'text' holds an unpaired surrogate escape",
    "array.jsonl": "array.jsonl line 3 (byte 16) is a JSON array, not an object; each line",
    "bare.jsonl": "bare.jsonl line 2 (byte 15) is a JSON number, not an object",
    "renamed.jsonl": "line 2 (byte 15) has no 'text' field (its fields: 'body'); name the text",
    "corpus.txt.gz": "unsupported input type .gz; decompress it first (gunzip -k",
    "rows.json": "unsupported input type .json; write one JSON object per line to a .jsonl",
    "link.txt": "link.txt is a broken link (to ",
    "empty.parquet": "/out: the --input files hold no text; check the --input files",
    "empty.txt": "no training tokens (every document is empty)",
    "numbers.parquet": "column 'text' holds int64, not text; name the text column",
    "garbled.parquet": "garbled.parquet is not a readable parquet file (",
}


def write_bad_input(folder, name):
    folder.mkdir()
    path = folder / name
    if name == "sub":
        path.mkdir()
    elif name == "numbers.parquet":
        pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    elif name == "empty.parquet":
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    elif name == "link.txt":
        path.symlink_to(folder / "moved-away.txt")
    elif name == "garbled.parquet":  # row groups garbled, footer intact: found only when read
        pq.write_table(pa.table({"text": texts(200)}), path, row_group_size=50)
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 3, 2 * len(data) // 3):
            data[i] ^= 0x5A
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(
            {
                "latin1.txt": "café résumé".encode("latin-1"),
                "binary.txt": bytes(range(256)) * 4,
                "latin1.jsonl": b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
                "number.jsonl": b'{"text": "ok"}\n{"text": 42}\n',
                "null.jsonl": b'{"text": null}\n',
                "list.jsonl": b'{"text": "ok"}\n{"text": ["a", "b"]}\n',
                "object.jsonl": b'{"text": "ok"}\n{"text": {"a": "b"}}\n',
                "broken.jsonl": b'{"text": "ok"}\n{"text": "unterminated\n',
                "surrogate.jsonl": b'{"text": "ok"}\n{"text": "cut \\ud83d emoji"}\n',
                "empty.txt": b"",
                "array.jsonl": b'{"text": "ok"}\n\n[1, 2]\n',
                "bare.jsonl": b'{"text": "ok"}\n7\n',
                "renamed.jsonl": b'{"text": "ok"}\n{"body": "x"}\n',
                "corpus.txt.gz": b"\x1f\x8b\x08\x00",
                "rows.json": b'[{"text": "ok"}]',
            }[name]
        )
    return path


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_inputs_prepare_would_misread_are_refused_in_one_line(tmp_path, capsys, name):
    """Before: a folder, an int text field and an empty file gave tracebacks or an unusable
    dataset, and non-UTF-8 bytes became U+FFFD replacement tokens without a word (and a JSON
    escape of an unpaired surrogate became '?', or a SentencePiece error blaming the vocab size).
    Then: a bad JSONL line was named by its byte alone, a line holding an array or a number was
    told to fix --text-field, a broken link was a FileNotFoundError traceback, and a .gz or
    .json file was refused without the conversion it needs."""
    path = write_bad_input(tmp_path / "in", name)
    assert prepare_main(["--input", str(path), "--output", str(tmp_path / "out")]) == 2
    assert BAD_INPUTS[name] in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_output_folder_of_other_files_is_refused_and_kept(tmp_path, capsys):
    """Before: publishing deleted a non-dataset --output folder with everything in it."""
    (tmp_path / "doc.txt").write_text(texts(1)[0])
    args = ["--input", str(tmp_path / "doc.txt"), "--eval-fraction", "0", "--output"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("keep me")
    (tmp_path / "a_file").write_text("keep me too")
    for output, message in [
        (mine, "is a folder that holds other files (notes.md), not a dataset"),
        (tmp_path / "a_file", "is a file; name a folder"),
        (tmp_path / "a_file" / "ds", "cannot create"),
    ]:
        for extra in ([], ["--overwrite"]):
            assert prepare_main([*args, str(output), *extra]) == 2
            assert message in capsys.readouterr().err
    assert (mine / "notes.md").read_text() == "keep me"
    assert (tmp_path / "a_file").read_text() == "keep me too"
    (tmp_path / "empty").mkdir()  # an empty folder is fine, and so is replacing a dataset
    assert prepare_main([*args, str(tmp_path / "empty")]) == 0
    assert prepare_main([*args, str(tmp_path / "empty"), "--overwrite"]) == 0


def test_held_out_text_without_tokens_is_refused_at_prepare(tmp_path, capsys):
    """Before: the dataset got an eval split of 0 records, and the run failed at its first
    eval, after training, blaming data.streams."""
    (tmp_path / "train.txt").write_text(texts(1)[0])
    (tmp_path / "held_out.txt").write_text("x")
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "train.txt"), "--eval-input", str(tmp_path / "held_out.txt")]
    assert prepare_main([*args, "--output", str(out)]) == 2
    assert "held-out documents of" in capsys.readouterr().err and not out.exists()


def test_null_texts_are_skipped_and_counted_alike_in_parquet_and_jsonl(tmp_path, capsys):
    """Before: parquet nulls were dropped without a word and a JSONL null refused the file."""
    docs = texts(20)
    with_nulls = [*docs[:5], None, *docs[5:12], None, None, *docs[12:]]
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in with_nulls)
    pq.write_table(pa.table({"body": with_nulls}), tmp_path / "docs.parquet")
    pq.write_table(pa.table({"body": docs}), tmp_path / "clean.parquet")
    splits = {}
    for name in ("docs.jsonl", "docs.parquet", "clean.parquet"):
        out = tmp_path / name.replace(".", "_")
        assert run_prepare("--input", tmp_path / name, "--output", out, "--text-field", "body") == 0
        said = capsys.readouterr().err.splitlines()
        info = load_dataset_info(out)
        splits[name] = info.raw["splits"]
        skipped = 0 if name == "clean.parquet" else 3
        assert info.raw.get("null_texts_skipped", 0) == skipped
        if skipped:
            assert said[-1] == "skipped 3 documents whose 'body' is null"
        else:
            assert "null" not in " ".join(said) and "null_texts_skipped" not in info.raw
    assert splits["docs.jsonl"] == splits["docs.parquet"] == splits["clean.parquet"]


def test_prepare_dataset_skips_and_counts_none_documents(tmp_path, capsys):
    """Before: a None document was an AttributeError traceback from the held-out split's hash."""
    docs = texts(10)
    out = prepare_dataset([None, *docs, None], tmp_path / "out", eval_fraction=0.1, progress=False)
    assert load_dataset_info(out).raw.get("null_texts_skipped", 0) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "skipped 2 documents that are None"
    clean = prepare_dataset(docs, tmp_path / "clean", eval_fraction=0.1, progress=False)
    assert load_dataset_info(out).raw["splits"] == load_dataset_info(clean).raw["splits"]
    with pytest.raises(DataError, match="a document is int, not text; pass str documents"):
        prepare_dataset([*docs, 7], tmp_path / "bad", progress=False)


@pytest.mark.parametrize("encoding", ["dictionary", "string_view", "large_string"])
def test_every_arrow_text_type_reads_as_text(tmp_path, capsys, encoding):
    """Before: a dictionary-encoded (pandas categorical) or string_view text column was refused
    as 'not text; name the text column with --text-field', naming the wrong problem and fix."""
    if encoding == "string_view" and not hasattr(pa, "string_view"):
        pytest.skip("string_view needs pyarrow >= 16")
    docs = [*texts(12), None, texts(1)[0]]  # a repeated text, as a categorical column holds
    column = {
        "dictionary": lambda: pa.array(docs).dictionary_encode(),
        "string_view": lambda: pa.array(docs, pa.string_view()),
        "large_string": lambda: pa.array(docs, pa.large_string()),
    }[encoding]()
    pq.write_table(pa.table({"text": column}), tmp_path / "typed.parquet")
    pq.write_table(pa.table({"text": docs}), tmp_path / "plain.parquet")
    for name in ("typed", "plain"):
        assert (
            run_prepare("--input", tmp_path / f"{name}.parquet", "--output", tmp_path / name) == 0
        )
        assert capsys.readouterr().err.splitlines()[-1] == "skipped 1 document whose 'text' is null"
    typed, plain = (load_dataset_info(tmp_path / n).raw["splits"] for n in ("typed", "plain"))
    assert typed == plain


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--group-mb", "nan"], "--group-mb nan is not a positive size; give MB"),
        (["--group-mb", "inf"], "--group-mb inf is not a positive size"),
        (["--group-mb", "0"], "--group-mb 0.0 is not a positive size"),
        (["--max-record-tokens", "0"], "--max-record-tokens 0 leaves no next-token pair"),
        (["--max-record-tokens", "1"], "--max-record-tokens 1 leaves no next-token pair"),
        (["--num-shards", "0"], "--num-shards 0 writes no shard; give at least 1"),
        (["--workers", "-3"], "--workers -3 is not a count; give 1 or more (0: every core)"),
        (["--eval-fraction", "1"], "--eval-fraction=1.0 must be in [0, 1): the share of"),
        (["--vocab-size", "32000"], "--vocab-size 32000 sizes a SentencePiece model trained"),
        (
            ["--tokenizer", "sentencepiece", "--vocab-size", "300"]
            + ["--tokenizer-sample-sentences", "0"],
            "--tokenizer-sample-sentences 0 gives SentencePiece no text to learn from",
        ),
    ],
)
def test_sizes_prepare_cannot_use_are_refused_in_one_line(tmp_path, capsys, option, message):
    """Before: nan/inf --group-mb and --max-record-tokens 0 were tracebacks, 0 MB groups cut
    every JSONL line into a group of its own, --max-record-tokens 1 blamed empty input, and
    --num-shards 0 and --workers -3 silently ran as 1. Then: --vocab-size with the byte
    tokenizer was ignored without a word, and --tokenizer-sample-sentences 0 failed in
    SentencePiece's training, blaming the vocabulary size."""
    (tmp_path / "doc.txt").write_text(texts(1)[0])
    out = tmp_path / "out"
    assert prepare_main(["--input", str(tmp_path / "doc.txt"), "--output", str(out), *option]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("held_out", ["empty.jsonl", "nulls.parquet"])
def test_eval_input_without_a_document_is_refused_at_prepare(tmp_path, capsys, held_out):
    """Before: the dataset silently got no eval split, though --eval-input asked for one."""
    (tmp_path / "train.txt").write_text(texts(1)[0])
    if held_out == "empty.jsonl":
        (tmp_path / held_out).write_text("")
    else:
        pq.write_table(pa.table({"text": pa.array([None, None], pa.string())}), tmp_path / held_out)
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "train.txt"), "--eval-input", str(tmp_path / held_out)]
    assert prepare_main([*args, "--output", str(out)]) == 2
    said = " (2 skipped for a null text)," if "nulls" in held_out else ","
    assert f"the --eval-input files of {out} hold no document{said}" in capsys.readouterr().err
    assert not out.exists()


def one_document(held_out: bool, fraction: float = 0.1) -> str:
    """A document --eval-fraction `fraction` holds out (or keeps for training)."""
    for i in range(1000):
        text = f"{texts(1)[0]}\nthe end, take {i}\n"
        if is_eval_document(text, fraction) == held_out:
            return text
    raise AssertionError("no such document")


def test_a_one_document_corpus_says_where_its_eval_split_went(tmp_path, capsys):
    """Before: nanoGPT's one input.txt with --eval-fraction 0.1 ended with 'no training
    documents; check the --input files' when the hash held the document out, and with no eval
    split and not a word about it otherwise."""
    (tmp_path / "eval.txt").write_text(one_document(held_out=True))
    (tmp_path / "train.txt").write_text(one_document(held_out=False))
    args = ["--eval-fraction", "0.1", "--no-progress", "--output"]
    out = tmp_path / "out"
    assert prepare_main(["--input", str(tmp_path / "eval.txt"), *args, str(out)]) == 2
    said = capsys.readouterr().err.splitlines()[-1]
    assert said.startswith(f"error: no training documents for {out}: --eval-fraction 0.1 held ")
    assert "out its one document for eval (it holds out whole documents" in said
    assert "lower --eval-fraction" in said and "--eval-input" in said
    assert not out.exists() and not (tmp_path / ".out.partial").exists()  # nothing to resume
    assert prepare_main(["--input", str(tmp_path / "train.txt"), *args, str(out)]) == 0
    said = capsys.readouterr().err.splitlines()[-1]
    assert said.startswith("no eval split: the corpus is one document (a .txt file is one)")
    assert "runs on it train without evals" in said
    assert "eval" not in load_dataset_info(out).raw["splits"]


def test_options_that_name_no_usable_thing_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Before: --output . was a ValueError traceback, and a damaged .model file was named by
    its copy in the hidden staging folder, a path the user never gave."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text(texts(1)[0])
    (tmp_path / "bad.model").write_bytes(b"not a model")
    for option, message in [
        (["--output", "."], "--output '.' names no new folder; give the dataset's own folder"),
        (["--output", "out", "--tokenizer", "bad.model"], "error: bad.model is not a readable"),
    ]:
        assert prepare_main(["--input", "doc.txt", "--no-progress", *option]) == 2
        said = capsys.readouterr().err
        assert message in said and ".partial" not in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.model", "doc.txt"]


def test_each_input_file_is_read_once_and_never_both_trained_and_evaluated(tmp_path, capsys):
    """Before: a held-out file that the --input glob matched too was trained on and evaluated,
    a file named twice (a.txt, ./a.txt) was two documents, and A.TXT was refused as
    unsupported."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, name in enumerate(["a.txt", "B.TXT", "held_out.txt"]):
        (corpus / name).write_text(texts(3)[i])
    out = tmp_path / "out"
    overlap = ["--input", f"{corpus}/*", "--eval-input", str(corpus / "held_out.txt")]
    assert prepare_main([*overlap, "--no-progress", "--output", str(out)]) == 2
    said = capsys.readouterr().err
    assert "held_out.txt matched both --input and --eval-input, so it would be trained" in said
    twice = ["--input", str(corpus / "a.txt"), "--input", f"{corpus}/./a.txt"]
    upper = ["--input", str(corpus / "B.TXT"), "--eval-input", str(corpus / "held_out.txt")]
    assert prepare_main([*twice, *upper, "--no-progress", "--output", str(out)]) == 0
    splits = load_dataset_info(out).raw["splits"]
    assert (splits["train"]["documents"], splits["eval"]["documents"]) == (2, 1)
    assert splits["train"]["tokens"] == len(texts(3)[0].encode()) + len(texts(3)[1].encode())


def test_a_utf8_byte_order_mark_is_not_text(tmp_path, capsys):
    """Before: a .jsonl file saved with a byte-order mark (PowerShell 5's utf8, Excel) was
    refused at its first line, whose fix 'remove that line' lost a document, and a .txt file
    trained on the mark's three bytes as text."""
    doc = texts(1)[0]
    lines = "".join(json.dumps({"text": t}) + "\r\n" for t in texts(4))
    for name, content in [("doc.txt", doc), ("docs.jsonl", lines)]:
        (tmp_path / name).write_text(content, newline="")
        (tmp_path / f"bom-{name}").write_text(content, encoding="utf-8-sig", newline="")
    for name in ("doc.txt", "docs.jsonl"):
        for prefix in ("", "bom-"):
            out = tmp_path / f"out-{prefix}{name}"
            args = ["--input", str(tmp_path / f"{prefix}{name}"), "--eval-fraction", "0"]
            assert prepare_main([*args, "--no-progress", "--output", str(out)]) == 0
        plain, marked = (load_dataset_info(tmp_path / f"out-{p}{name}").raw for p in ("", "bom-"))
        assert plain["splits"] == marked["splits"]
