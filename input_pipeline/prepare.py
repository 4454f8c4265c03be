"""Tokenize text once, offline, into sharded records plus `dataset.json`.

    python -m input_pipeline.prepare --input 'corpus/*.txt' --output data/mycorpus \\
        [--eval-fraction 0.01 | --eval-input 'held_out/*.txt'] [--overwrite] \\
        [--format arrayrecord|tfrecord]

`.txt` files are one document each; `.jsonl` files hold one document per line in a `text` field;
`.parquet` files hold one document per row in a `text` column (`--text-field` names another).
`--tokenizer sentencepiece --vocab-size N` trains a SentencePiece model on the training text;
`--tokenizer PATH.model` uses an existing one. Either is stored in the dataset folder.
The output appears atomically: a killed prepare never leaves a folder that looks complete.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

from input_pipeline import tfrecords
from input_pipeline.dataset_info import INFO_FILE
from input_pipeline.errors import DataError
from input_pipeline.records import split_long, token_dtype, write_shards
from input_pipeline.tokenizers import Tokenizer, make_tokenizer

DEFAULT_MAX_RECORD_TOKENS = 16384
ENCODE_BATCH = 256  # documents per tokenizer call
WRITERS = {"arrayrecord": write_shards, "tfrecord": tfrecords.write_shards}  # by --format


def is_eval_document(text: str, eval_fraction: float) -> bool:
    """Deterministic by content: the same corpus always gives the same held-out split."""
    digest = hashlib.sha256(text.encode("utf-8", errors="replace")).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < eval_fraction


def prepare_dataset(
    documents: Iterable[str],
    output_dir: str | Path,
    *,
    eval_fraction: float = 0.01,
    eval_documents: Iterable[str] | None = None,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    num_shards: int = 4,
    format: str = "arrayrecord",
    max_record_tokens: int = DEFAULT_MAX_RECORD_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write `output_dir` with train/eval shards and `dataset.json`; return it.

    `tokenizer` is `byte`, `sentencepiece` (trained here on the training documents, with
    `vocab_size` pieces) or the path of an existing SentencePiece `.model` file; a SentencePiece
    model is stored in the dataset folder.
    """
    output = Path(output_dir)
    if (output / INFO_FILE).exists() and not overwrite:
        raise DataError(f"{output} already holds a dataset; pass --overwrite to replace it")
    if format not in WRITERS:
        raise DataError(f"--format {format} is unknown; use one of {', '.join(WRITERS)}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"--eval-fraction={eval_fraction} must be in [0, 1)")
    train, held_out = [], []
    for text in documents:
        if eval_documents is None and is_eval_document(text, eval_fraction):
            held_out.append(text)
        else:
            train.append(text)
    if eval_documents is not None:
        held_out = list(eval_documents)
    elif eval_fraction > 0 and not held_out and len(train) > 1:
        held_out.append(train.pop())  # a tiny corpus still gets an eval split
    if not train:
        raise DataError(f"no training documents for {output}; check the --input files")

    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok = make_tokenizer(tokenizer, tmp, train, vocab_size)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dtype = token_dtype(tok.vocab_size)
    splits = {}
    for name, texts in (("train", train), ("eval", held_out)):
        if not texts:
            continue
        desc = f"tokenizing {output.name} {name}"
        bar = tqdm(total=len(texts), unit="doc", desc=desc, disable=not progress)
        records = _records(texts, tok, max_record_tokens, bar)
        shards = WRITERS[format](records, tmp, name, min(num_shards, len(texts)), dtype)
        splits[name] = {
            "documents": len(texts),
            "records": sum(s["records"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "shards": shards,
        }
    info = {
        "format": format,
        "tokenizer": tok.spec(),
        "vocab_size": tok.vocab_size,
        "token_dtype": dtype.str,
        "max_record_tokens": max_record_tokens,
        "splits": splits,
    }
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
    _publish(tmp, output, overwrite)
    return output


def _records(texts: list[str], tok: Tokenizer, max_record_tokens: int, bar: tqdm) -> Iterator:
    """Token arrays of at least 2 tokens (one next-token pair), long documents cut. Documents
    are encoded a batch at a time, which a SentencePiece model spreads over every core."""
    for start in range(0, len(texts), ENCODE_BATCH):
        batch = texts[start : start + ENCODE_BATCH]
        for tokens in tok.encode_batch(batch):
            for piece in split_long(tokens, max_record_tokens):
                if len(piece) >= 2:
                    yield piece
        bar.update(len(batch))
    bar.close()


def _publish(tmp: Path, output: Path, overwrite: bool) -> None:
    """Move the finished folder into place; a concurrent winner is kept, not clobbered."""
    if output.exists():
        if overwrite:
            shutil.rmtree(output)
        elif (output / INFO_FILE).exists():
            shutil.rmtree(tmp)  # someone else finished the same dataset first
            return
        else:
            shutil.rmtree(output)  # leftovers of an older, interrupted layout
    output.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, output)


# ----------------------------------------------------------------------------- CLI


def read_documents(patterns: list[str], text_field: str = "text") -> list[str]:
    """Documents from `.txt` files (one each), `.jsonl` files (a `text_field` per line) and
    `.parquet` files (a `text_field` column)."""
    files = sorted({f for pattern in patterns for f in glob.glob(pattern, recursive=True)})
    if not files:
        raise DataError(f"--input {' '.join(patterns)} matches no file; check the path or quoting")
    docs = []
    for name in files:
        path = Path(name)
        if path.suffix == ".jsonl":
            docs.extend(_jsonl_texts(path, text_field))
        elif path.suffix == ".parquet":
            docs.extend(_parquet_texts(path, text_field))
        elif path.suffix in (".txt", ".py", ".md", ""):
            docs.append(path.read_text(encoding="utf-8", errors="replace"))
        else:
            raise DataError(
                f"{path}: unsupported input type {path.suffix}; use .txt, .jsonl or .parquet"
            )
    return docs


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_field]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(
                    f"{path}:{number} is not a JSON object with a {text_field!r} field; "
                    "name the field with --text-field"
                ) from None
            yield text


def _parquet_texts(path: Path, text_field: str) -> Iterator[str]:
    """The text column, read a row group at a time so a large file never sits in memory twice."""
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own ArrowInvalid / OSError family
        raise DataError(f"{path} is not a readable parquet file ({err})") from None
    columns = table.schema_arrow.names
    if text_field not in columns:
        raise DataError(
            f"{path} has no column {text_field!r} (columns: {', '.join(columns)}); name the "
            "text column with --text-field"
        )
    for batch in table.iter_batches(columns=[text_field]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m input_pipeline.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--input", action="append", required=True, help="glob of input files")
    parser.add_argument("--output", required=True, help="dataset folder to create")
    parser.add_argument("--eval-fraction", type=float, default=0.01)
    parser.add_argument("--eval-input", action="append", help="glob of held-out files")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default), sentencepiece (trained here; needs --vocab-size) or PATH.model",
    )
    parser.add_argument("--vocab-size", type=int, help="pieces of a trained SentencePiece model")
    parser.add_argument(
        "--text-field", default="text", help="JSON field / parquet column holding the text"
    )
    parser.add_argument("--format", default="arrayrecord", choices=list(WRITERS))
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--max-record-tokens", type=int, default=DEFAULT_MAX_RECORD_TOKENS)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        out = prepare_dataset(
            read_documents(args.input, args.text_field),
            args.output,
            eval_fraction=args.eval_fraction,
            eval_documents=(
                read_documents(args.eval_input, args.text_field) if args.eval_input else None
            ),
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            num_shards=args.num_shards,
            format=args.format,
            max_record_tokens=args.max_record_tokens,
            overwrite=args.overwrite,
        )
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    info = json.loads((out / INFO_FILE).read_text())
    for name, split in info["splits"].items():
        print(
            f"{name}: {split['documents']} documents, {split['tokens']:,} tokens", file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
