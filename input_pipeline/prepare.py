"""Tokenize text once, offline, into sharded records plus `dataset.json`.

    python -m input_pipeline.prepare --input 'corpus/*.txt' --output data/mycorpus \\
        [--eval-fraction 0.01 | --eval-input 'held_out/*.txt'] [--overwrite] \\
        [--format arrayrecord|tfrecord] [--workers N] [--num-parts N --part i | --merge]

`.txt` files are one document each; `.jsonl` files hold one document per line in a `text` field;
`.parquet` files hold one document per row in a `text` column (`--text-field` names another). A
row or line whose text is null is skipped and counted (the last line says how many; `dataset.json`
records it as `null_texts_skipped`); any other value that is not text is refused.
`--eval-fraction` holds out whole documents, chosen by content: a corpus of one `.txt` file gets
no eval split (said in one line), or none to train on; name held-out files with `--eval-input`.
`--tokenizer sentencepiece --vocab-size N` trains a SentencePiece model on a bounded sample of the
training text (`--tokenizer-sample-sentences`); `--tokenizer PATH.model` uses an existing one, and
`--tokenizer hf:PATH` a Hugging Face folder's `tokenizer.json` (offline, `tokenizers` library).
Each is stored in the dataset folder.

Documents stream from the files to the shard writers in groups of about `--group-mb` of input,
tokenized by `--workers` processes (default: every core), so memory grows neither with the corpus
nor with its number of groups (each process hands a finished group's memory back). Groups are
written into `.<output>.partial/` and marked finished one by one: re-running a killed (or
Ctrl-C'd) prepare with the same command resumes it, and one with changed input files (a fixed
line, an added file) keeps the groups whose files are unchanged; one with other options is
refused while groups are finished (delete that folder to start over).
`--num-parts N --part i` prepares one slice of the groups (a Slurm array task, or one of N
processes); the last part to finish, or a final run with `--merge`, writes `dataset.json`. The
output appears atomically: a killed prepare never leaves a folder that looks complete.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import uuid
from collections.abc import Iterable, Sequence, Sized
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from input_pipeline.dataset_info import INFO_FILE, NULL_TEXTS
from input_pipeline.documents import check_disjoint, input_files, plan_groups, sample_lines
from input_pipeline.errors import DataError
from input_pipeline.records import token_dtype
from input_pipeline.shard_groups import (
    Recipe,
    Source,
    finished,
    group_folder,
    is_eval_document,
    write_group,
)
from input_pipeline.staging import (
    check_output_folder,
    check_output_name,
    finish,
    make_folder,
    open_staging,
    part_groups,
    part_of,
    run_groups,
    staged_tokenizer,
    take_merge_lock,
)
from input_pipeline.tokenizers import (
    TRAINING_SENTENCES,
    SentencePieceTokenizer,
    Tokenizer,
    make_tokenizer,
)

__all__ = ["is_eval_document", "main", "prepare_dataset", "prepare_files"]

DEFAULT_MAX_RECORD_TOKENS = 16384
DEFAULT_GROUP_MB = 64.0  # input per group: the unit of resume and of work for one process
FORMATS = ("arrayrecord", "tfrecord")


def prepare_dataset(
    documents: Iterable[str | None],
    output_dir: str | Path,
    *,
    eval_fraction: float = 0.01,
    eval_documents: Iterable[str | None] | None = None,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    num_shards: int = 4,
    format: str = "arrayrecord",
    max_record_tokens: int = DEFAULT_MAX_RECORD_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
    sample_sentences: int = TRAINING_SENTENCES,
) -> Path:
    """Write `output_dir` with train/eval shards and `dataset.json` from documents in memory
    or streamed by any iterable (one process; `prepare_files` is the resumable, parallel path).
    `tokenizer` takes the `--tokenizer` values of the module docstring. A `None` document is
    skipped and counted, as a null text is by the CLI, and said on stderr."""
    output = Path(output_dir)
    check_output_name(output)
    _check_options(output, overwrite, format, eval_fraction, max_record_tokens)
    _check_tokenizer_options(tokenizer, vocab_size, sample_sentences)
    # a name no other preparer uses: one by pid is the same for two hosts' processes of equal
    # pids (containers), which prepare the same built-in corpus into a shared cache at once
    staging = output.with_name(f".{output.name}.tmp-{uuid.uuid4().hex}")
    make_folder(staging)
    explicit = eval_documents is not None
    try:
        if tokenizer == "sentencepiece" and not isinstance(documents, Sequence):
            documents = list(documents)  # read twice: a sample to train on, then all of it
        train = (
            t
            for t in documents
            if isinstance(t, str) and (explicit or not is_eval_document(t, eval_fraction))
        )
        tok = make_tokenizer(tokenizer, staging, train, vocab_size, sample_sentences)
        recipe = _recipe(tok, format, eval_fraction, explicit, num_shards, max_record_tokens)
        sources: list[Source] = [(documents, "train" if explicit else None)]
        if eval_documents is not None:
            sources.append((eval_documents, "eval"))
        total = len(documents) if isinstance(documents, Sized) else None
        bar = tqdm(total=total, unit="doc", desc=f"tokenizing {output.name}", disable=not progress)
        write_group(
            group_folder(staging, 0), sources, recipe, tok, last_group=True, on_document=bar.update
        )
        bar.close()
        finish(staging, output, 1, recipe, tok, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    info = json.loads((output / INFO_FILE).read_text())
    say_null_texts(info.get(NULL_TEXTS, 0), "that are None")
    return output


def prepare_files(
    inputs: list[str],
    output_dir: str | Path,
    *,
    eval_inputs: list[str] | None = None,
    text_field: str = "text",
    eval_fraction: float = 0.01,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    num_shards: int = 4,
    format: str = "arrayrecord",
    max_record_tokens: int = DEFAULT_MAX_RECORD_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
    workers: int | None = None,
    group_mb: float = DEFAULT_GROUP_MB,
    sample_sentences: int = TRAINING_SENTENCES,
    num_parts: int = 1,
    part: int = 0,
    merge: bool = False,
) -> Path | None:
    """Prepare the files the `inputs` globs match, streaming, on `workers` processes, resuming
    finished groups; with `num_parts > 1` only part `part` of them. Returns the dataset folder
    once it is complete, or None while other parts still have groups to write."""
    output = Path(output_dir)
    check_output_name(output)
    staging = output.with_name(f".{output.name}.partial")
    if merge and (output / INFO_FILE).exists() and not staging.exists():
        return output  # the last part to finish merged already
    files = input_files(inputs)
    _check_options(output, overwrite, format, eval_fraction, max_record_tokens)
    if not 0 < group_mb < math.inf:  # also NaN
        raise DataError(
            f"--group-mb {group_mb} is not a positive size; give MB of input per "
            f"group, e.g. the default {DEFAULT_GROUP_MB:g}"
        )
    if num_shards < 1:
        raise DataError(f"--num-shards {num_shards} writes no shard; give at least 1 (default 4)")
    if workers is not None and workers < 0:
        raise DataError(f"--workers {workers} is not a count; give 1 or more (0: every core)")
    if num_parts < 1 or not 0 <= part < num_parts:
        raise DataError(f"--part {part} is not in 0..{num_parts - 1} (--num-parts {num_parts})")
    _check_tokenizer_options(tokenizer, vocab_size, sample_sentences)
    eval_files = input_files(eval_inputs, "--eval-input") if eval_inputs else []
    check_disjoint(files, eval_files)
    groups = plan_groups(files, eval_files, max(1, int(group_mb * 2**20)))
    explicit = bool(eval_files)
    options = {
        "eval_fraction": eval_fraction,
        "explicit_eval": explicit,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "sample_sentences": sample_sentences,
        "num_shards": num_shards,
        "format": format,
        "max_record_tokens": max_record_tokens,
        "text_field": text_field,
    }
    sizes = {str(f): f.stat().st_size for f in [*files, *eval_files]}
    plan = json.loads(json.dumps({"options": options, "sizes": sizes, "groups": groups}))
    open_staging(staging, plan, shared=num_parts > 1 or merge)

    def is_train(text: str) -> bool:
        return explicit or not is_eval_document(text, eval_fraction)

    pieces = [p for group in groups for p in group]
    sample = sample_lines(pieces, sample_sentences, text_field, is_train)  # read lazily, if at all
    tok = staged_tokenizer(staging, tokenizer, vocab_size, sample, sample_sentences)
    recipe = _recipe(tok, format, eval_fraction, explicit, num_shards, max_record_tokens)
    recipe = replace(recipe, text_field=text_field)
    count = len(groups)
    mine = [] if merge else list(part_groups(count, num_parts, part))
    pending = [i for i in mine if finished(staging, i) is None]
    run_groups(staging, groups, pending, recipe, workers, progress, output.name)
    unfinished = [i for i in range(count) if finished(staging, i) is None]
    if unfinished:
        if merge:
            parts = sorted({part_of(i, count, num_parts) for i in unfinished})
            raise DataError(
                f"cannot merge {output}: parts {parts} of --num-parts {num_parts} have not "
                "finished; run them (a re-run resumes), then --merge again"
            )
        return None
    if not take_merge_lock(staging, force=merge or num_parts == 1):
        return None
    finish(staging, output, count, recipe, tok, overwrite)
    return output


def _check_options(
    output: Path, overwrite: bool, format: str, eval_fraction: float, max_record_tokens: int
) -> None:
    if (output / INFO_FILE).exists() and not overwrite:
        raise DataError(f"{output} already holds a dataset; pass --overwrite to replace it")
    check_output_folder(output)
    if format not in FORMATS:
        raise DataError(f"--format {format} is unknown; use one of {', '.join(FORMATS)}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(
            f"--eval-fraction={eval_fraction} must be in [0, 1): the share of documents held out "
            "for evals, e.g. 0.01 (0: no eval split)"
        )
    if max_record_tokens < 2:  # a record is trained on as next-token pairs
        raise DataError(
            f"--max-record-tokens {max_record_tokens} leaves no next-token pair in a record; give "
            f"at least 2 (default {DEFAULT_MAX_RECORD_TOKENS})"
        )


def _check_tokenizer_options(tokenizer: str, vocab_size: int | None, sample_sentences: int) -> None:
    """Refuse tokenizer options that would be ignored or fail late, and a `.model` file that is
    not one (named as given, before it is copied into the staging folder)."""
    if vocab_size is not None and tokenizer != "sentencepiece":
        raise DataError(
            f"--vocab-size {vocab_size} sizes a SentencePiece model trained here, but --tokenizer "
            f"{tokenizer} brings its own vocabulary; add --tokenizer sentencepiece, or drop "
            "--vocab-size"
        )
    if sample_sentences < 1:
        raise DataError(
            f"--tokenizer-sample-sentences {sample_sentences} gives SentencePiece no text to "
            f"learn from; give 1 or more lines (default {TRAINING_SENTENCES:,})"
        )
    if tokenizer.endswith(".model") and Path(tokenizer).is_file():
        SentencePieceTokenizer(tokenizer)  # a DataError naming the file when it is not a model


def _recipe(
    tok: Tokenizer,
    format: str,
    eval_fraction: float,
    explicit: bool,
    num_shards: int,
    max_record_tokens: int,
) -> Recipe:
    model = getattr(tok, "model_file", None)  # SentencePiece's .model, or a tokenizer.json
    return Recipe(
        format=format,
        eval_fraction=eval_fraction,
        explicit_eval=explicit,
        num_shards=num_shards,
        max_record_tokens=max_record_tokens,
        token_dtype=token_dtype(tok.vocab_size).str,
        tokenizer_file=None if model is None else str(model),
    )


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m input_pipeline.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Destinations are `prepare_files`' parameter names: the parsed arguments are its call.
    parser.add_argument(
        "--input", dest="inputs", action="append", required=True, help="glob of input files"
    )
    parser.add_argument(
        "--output", dest="output_dir", required=True, help="dataset folder to create"
    )
    parser.add_argument("--eval-fraction", type=float, default=0.01)
    parser.add_argument(
        "--eval-input", dest="eval_inputs", action="append", help="glob of held-out files"
    )
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default), sentencepiece (trained here; needs --vocab-size), PATH.model, "
        "or hf:PATH (a Hugging Face folder's tokenizer.json)",
    )
    parser.add_argument("--vocab-size", type=int, help="pieces of a trained SentencePiece model")
    parser.add_argument(
        "--tokenizer-sample-sentences",
        dest="sample_sentences",
        type=int,
        default=TRAINING_SENTENCES,
        help=f"lines of training text SentencePiece learns from (default {TRAINING_SENTENCES:,})",
    )
    parser.add_argument(
        "--text-field", default="text", help="JSON field / parquet column holding the text"
    )
    parser.add_argument("--format", default="arrayrecord", choices=list(FORMATS))
    parser.add_argument("--num-shards", type=int, default=4, help="shards per group and split")
    parser.add_argument("--max-record-tokens", type=int, default=DEFAULT_MAX_RECORD_TOKENS)
    parser.add_argument(
        "--workers", type=int, help="tokenizing processes (default, or 0: every core)"
    )
    parser.add_argument(
        "--group-mb", type=float, default=DEFAULT_GROUP_MB, help="input per resumable group"
    )
    parser.add_argument("--num-parts", type=int, default=1, help="hosts preparing together")
    parser.add_argument("--part", type=int, default=0, help="this host's part, 0..N-1")
    parser.add_argument(
        "--merge", action="store_true", help="write dataset.json once every part has finished"
    )
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    args = parser.parse_args(argv)
    try:
        out = prepare_files(**vars(args))
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say_interrupted(Path(args.output_dir))
        return 130
    if out is None:
        print(
            f"part {args.part} of {args.num_parts} done; the last part to finish (or --merge) "
            f"writes {args.output_dir}",
            file=sys.stderr,
        )
        return 0
    info = json.loads((out / INFO_FILE).read_text())
    for name, split in info["splits"].items():
        print(
            f"{name}: {split['documents']} documents, {split['tokens']:,} tokens", file=sys.stderr
        )
    say_null_texts(info.get(NULL_TEXTS, 0), f"whose {args.text_field!r} is null")
    if args.eval_fraction > 0 and not args.eval_inputs and "eval" not in info["splits"]:
        say_no_eval_split(args.eval_fraction, info["splits"]["train"]["documents"])
    return 0


def say_no_eval_split(eval_fraction: float, documents: int) -> None:
    """One line when `--eval-fraction` asked for held-out text and the dataset got none (a
    corpus of one document, which training keeps): runs on it would skip evals unannounced."""
    if documents == 1:
        held = (
            f"the corpus is one document (a .txt file is one), which training keeps, so "
            f"--eval-fraction {eval_fraction:g} held out none"
        )
    else:
        held = f"--eval-fraction {eval_fraction:g} held out none of the {documents:,} documents"
    print(
        f"no eval split: {held}; runs on it train without evals. For evals give more documents "
        "(a .jsonl file holds one a line) or name held-out text with --eval-input",
        file=sys.stderr,
    )


def say_interrupted(output: Path) -> None:
    """Ctrl-C's one line, instead of a traceback from every process: what is kept and how the
    same command resumes it."""
    staging = output.with_name(f".{output.name}.partial")
    kept = (
        f"the finished groups stay in {staging}: re-run the same command to resume"
        if staging.is_dir()
        else "nothing was written"
    )
    print(f"interrupted: {output} was not written; {kept}", file=sys.stderr)


def say_null_texts(skipped: int, which: str) -> None:
    """One line when prepare left documents out for a null text: never a silent loss."""
    if skipped:
        noun = "document" if skipped == 1 else "documents"
        print(f"skipped {skipped:,} {noun} {which}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
