"""The staging folder of a file prepare: its plan, the shared tokenizer, the groups written on
worker processes, and the merge that publishes the dataset atomically.

`.<output>.partial/` holds `plan.json` (inputs, options and groups: a re-run with the same plan
resumes, one with changed files keeps the groups it would write the same, parts check they
agree), `tokenizer.model` when SentencePiece is used, and one `group-NNNNN/` folder per group,
finished when its `done.json` exists. The merge moves the shards to their global names, records
each one's stamp there with its sha256 (`PreparedShards`: a first start of the trainer hashes
none that is unchanged since), writes `dataset.json` (with `null_texts_skipped`, the documents
left out for a null text, when there were any), and renames the folder to the output (which
leaves the files in it as they are).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.pool
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from input_pipeline.atomic import write_json
from input_pipeline.dataset_info import INFO_FILE, NULL_TEXTS
from input_pipeline.documents import Piece
from input_pipeline.errors import DataError
from input_pipeline.shard_groups import (
    Recipe,
    finished,
    group_folder,
    merge_groups,
    prepare_file_group,
    run_file_group,
)
from input_pipeline.tokenizers import (
    HF_PREFIX,
    SENTENCEPIECE_FILE,
    SentencePieceTokenizer,
    Tokenizer,
    make_tokenizer,
)
from input_pipeline.verified import PreparedShards

PLAN_FILE = "plan.json"
MERGE_LOCK = "merging"


def part_groups(count: int, num_parts: int, part: int) -> range:
    """Part `part`'s contiguous slice of the groups."""
    return range(part * count // num_parts, (part + 1) * count // num_parts)


def part_of(group: int, count: int, num_parts: int) -> int:
    return next(p for p in range(num_parts) if group in part_groups(count, num_parts, p))


def open_staging(staging: Path, plan: dict[str, Any], shared: bool) -> None:
    """Resume a staging folder made by the same plan. A plan of other options is refused, naming
    them, where groups are finished (hours of work, which a flag changed after a kill must not
    delete unasked), and any other plan where parts share the folder (another may be working in
    it); a single host's prepare of changed input files (a fixed line, an added file) keeps the
    finished groups whose input is unchanged and redoes the others."""
    plan_file = staging / PLAN_FILE
    if plan_file.exists():
        old = json.loads(plan_file.read_text())
        done = sum(finished(staging, i) is not None for i in range(len(old["groups"])))
        progress = f"{done} of {len(old['groups'])} groups done"
        if old == plan:
            if done:
                print(
                    f"resuming {staging}: {done} of {len(plan['groups'])} groups already done",
                    file=sys.stderr,
                )
            return
        change = plan_change(old, plan)
        if shared or (done and old["options"] != plan["options"]):
            raise DataError(
                f"{staging} holds a prepare made with {change} ({progress}); re-run with the "
                "arguments it was made with to resume it, or delete that folder to start over"
            )
        kept = reusable_groups(staging, old, plan)
        if kept:
            for i in set(range(len(old["groups"]))) - set(kept):
                shutil.rmtree(group_folder(staging, i), ignore_errors=True)
            print(
                f"{staging} was made with {change}: keeping the {len(kept)} of {done} finished "
                "groups whose input files are unchanged, redoing the rest",
                file=sys.stderr,
            )
        else:
            print(f"discarding {staging} ({progress}): it was made with {change}", file=sys.stderr)
            shutil.rmtree(staging)
    make_folder(staging)
    write_json(plan_file, plan)  # parts starting together write the same plan


def reusable_groups(staging: Path, old: dict[str, Any], new: dict[str, Any]) -> list[int]:
    """The finished groups of the `old` plan that the `new` one would write again byte for byte:
    same index, same pieces of files of the same sizes, same options, and last in both or in
    neither (the last group keeps the fallback eval document aside). None where a SentencePiece
    model was trained on a sample of all the old inputs, or a merge began (it moves shards)."""
    if (
        old["options"] != new["options"]
        or old["options"]["tokenizer"] == "sentencepiece"
        or (staging / MERGE_LOCK).exists()
    ):
        return []
    last_old, last_new = len(old["groups"]) - 1, len(new["groups"]) - 1
    return [
        i
        for i, (before, now) in enumerate(zip(old["groups"], new["groups"], strict=False))
        if before == now
        and all(old["sizes"].get(p["file"]) == new["sizes"].get(p["file"]) for p in now)
        and (i == last_old) == (i == last_new)
        and finished(staging, i) is not None
    ]


OPTION_FLAGS = {"explicit_eval": "--eval-input", "sample_sentences": "--tokenizer-sample-sentences"}


def plan_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What a staging folder's plan had that this run's lacks, in the user's words: the options
    as flags, then the input files (added, left out or of another size), then --group-mb."""
    changes = [
        _as_flag(key, value)
        for key, value in old["options"].items()
        if new["options"].get(key) != value
    ]
    before, now = old["sizes"], new["sizes"]
    files = sorted(set(before) | set(now))
    changed = [
        f"{f} {'is new' if f not in before else 'is gone' if f not in now else 'changed size'}"
        for f in files
        if before.get(f) != now.get(f)
    ]
    if changed:
        more = f" and {len(changed) - 1:,} more" if len(changed) > 1 else ""
        changes.append(f"other input files ({changed[0]}{more})")
    if not changed and old["groups"] != new["groups"]:
        changes.append("another --group-mb")
    return ", ".join(changes) or "other inputs or options"


def _as_flag(option: str, value: Any) -> str:
    """A plan option as the command line gave it: `--num-shards 4`, `no --vocab-size`."""
    flag = OPTION_FLAGS.get(option, "--" + option.replace("_", "-"))
    if value is None or value is False:
        return f"no {flag}"
    return flag if value is True else f"{flag} {value}"


def check_output_name(output: Path) -> None:
    """Refuse an `--output` without a folder name of its own (`''`, `.`, `..`, `/`): the working
    folder is named after it, beside it."""
    if output.name in ("", ".", ".."):
        raise DataError(
            f"--output {str(output)!r} names no new folder; give the dataset's own folder, "
            "e.g. data/mycorpus"
        )


def check_output_folder(output: Path) -> None:
    """Refuse, before any work, an `--output` that is a file or a folder of someone's files:
    publishing replaces the output folder, and only a dataset (`--overwrite`) or an empty
    folder may be replaced."""
    if output.exists() and not output.is_dir():
        raise DataError(f"--output {output} is a file; name a folder for the dataset")
    if output.is_dir() and not (output / INFO_FILE).exists():
        held = sorted(p.name for p in output.iterdir())
        if held:
            raise DataError(
                f"--output {output} is a folder that holds other files ({', '.join(held[:3])}"
                f"{', ...' if len(held) > 3 else ''}), not a dataset; name a new or empty "
                "folder, or move those files away"
            )


def make_folder(folder: Path) -> None:
    """Create the working folder beside `--output`; one line when that place is not writable."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"cannot create {folder} ({err.strerror}); name an --output in a writable folder"
        ) from None


def staged_tokenizer(
    staging: Path,
    choice: str,
    vocab_size: int | None,
    sample: Iterable[str],
    sample_sentences: int,
) -> Tokenizer:
    """The tokenizer every part shares: the first part to train (or copy) a SentencePiece model
    links it into the staging folder, and every part uses that one. `sample` is read only to
    train one, so a lazy generator costs nothing otherwise."""
    if choice == "byte" or choice.startswith(HF_PREFIX):  # hf: every part copies the same file
        return make_tokenizer(choice, staging)
    target = staging / SENTENCEPIECE_FILE
    if not target.exists():
        private = staging / f".tokenizer-{socket.gethostname()}-{os.getpid()}"
        private.mkdir(exist_ok=True)
        try:
            make_tokenizer(choice, private, sample, vocab_size, sample_sentences)
            with contextlib.suppress(FileExistsError):  # another part was first: use its model
                os.link(private / SENTENCEPIECE_FILE, target)
        finally:
            shutil.rmtree(private, ignore_errors=True)
    return SentencePieceTokenizer(target)


def run_groups(
    staging: Path,
    groups: list[list[Piece]],
    pending: list[int],
    recipe: Recipe,
    workers: int | None,
    progress: bool,
    name: str,
) -> None:
    """Write the `pending` groups, each on one of `workers` processes (spawned: safe beside
    threads), with a progress bar over input bytes."""
    if not pending:
        return
    cores = os.cpu_count() or 1
    workers = max(1, min(workers or cores, len(pending)))
    tasks = [
        (str(staging), i, groups[i], asdict(recipe), i == len(groups) - 1, max(1, cores // workers))
        for i in pending
    ]
    total = sum(p["end"] - p["start"] for i in pending for p in groups[i])
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"tokenizing {name}", disable=not progress
    ) as bar:
        if workers == 1:
            for task in tasks:
                bar.update(prepare_file_group(*task))
            return
        with _pool_deaf_to_ctrl_c(workers) as pool:
            for done in pool.imap_unordered(run_file_group, tasks):
                bar.update(done)


def _pool_deaf_to_ctrl_c(workers: int) -> multiprocessing.pool.Pool:
    """A spawned pool whose processes ignore SIGINT from their first instruction (an ignored
    signal stays ignored across exec), so Ctrl-C stops the parent alone, which says so in one
    line and terminates them, instead of a traceback from every process."""
    if threading.current_thread() is not threading.main_thread():
        return multiprocessing.get_context("spawn").Pool(workers)
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return multiprocessing.get_context("spawn").Pool(workers)
    finally:
        signal.signal(signal.SIGINT, handler)


def take_merge_lock(staging: Path, force: bool) -> bool:
    """One merger among parts that finish together; `--merge` (or one host) always merges."""
    try:
        (staging / MERGE_LOCK).mkdir()
    except FileExistsError:
        return force
    return True


def finish(
    staging: Path, output: Path, count: int, recipe: Recipe, tok: Tokenizer, overwrite: bool
) -> None:
    """Merge the finished groups into one dataset and publish it atomically."""
    splits, null_texts, stamps = merge_groups(staging, count, recipe)
    problem = unusable_dataset(output, splits, null_texts, recipe)
    if problem:  # its groups make no dataset: a re-run with the input fixed starts afresh
        shutil.rmtree(staging, ignore_errors=True)
        raise DataError(problem)
    info = {
        "format": recipe.format,
        "tokenizer": tok.spec(),
        "vocab_size": tok.vocab_size,
        "token_dtype": recipe.token_dtype,
        "max_record_tokens": recipe.max_record_tokens,
        "splits": splits,
    }
    if null_texts:  # absent when none: a clean corpus's dataset.json (and fingerprint) as before
        info[NULL_TEXTS] = null_texts
    PreparedShards.write(staging, stamps)  # the shards are in place: no rename touches them now
    write_json(staging / INFO_FILE, info)
    for i in range(count):
        shutil.rmtree(group_folder(staging, i), ignore_errors=True)
    (staging / PLAN_FILE).unlink(missing_ok=True)
    shutil.rmtree(staging / MERGE_LOCK, ignore_errors=True)
    publish(staging, output, overwrite)


def unusable_dataset(
    output: Path, splits: dict[str, Any], null_texts: int, recipe: Recipe
) -> str | None:
    """Why finished groups make no usable dataset (no training text, or held-out text without
    a next-token pair), in one line naming the fix; None when they make one."""
    nulls = f" ({null_texts} skipped for a null text)" if null_texts else ""
    train = splits.get("train", {})
    held_out = splits.get("eval", {})
    if not train.get("documents") and held_out.get("documents") and not recipe.explicit_eval:
        return _all_held_out(output, held_out["documents"], recipe.eval_fraction)
    if not train.get("records"):
        what = "documents" if not train.get("documents") else "tokens (every document is empty)"
        why = "" if train.get("documents") else ": the --input files hold no text"
        field = " and --text-field" if null_texts else ""
        return f"no training {what}{nulls} for {output}{why}; check the --input files{field}"
    if recipe.explicit_eval and not held_out.get("documents"):
        return (
            f"the --eval-input files of {output} hold no document{nulls}, so it would have no "
            "eval split; name held-out text with --eval-input, or leave it out and use "
            "--eval-fraction"
        )
    if held_out.get("documents") and not held_out.get("records"):
        return (
            f"the {held_out['documents']} held-out documents of {output} hold no next-token "
            "pair (each is empty or one token); give longer held-out text (--eval-input), a "
            "larger --eval-fraction, or --eval-fraction 0 for a dataset without evals"
        )
    return None


def _all_held_out(output: Path, documents: int, eval_fraction: float) -> str:
    """The line for a corpus whose every document `--eval-fraction` held out: it holds out whole
    documents, so a corpus of one (a single .txt file) or a few can lose all of them to eval."""
    which = "its one document" if documents == 1 else f"all {documents:,} of its documents"
    return (
        f"no training documents for {output}: --eval-fraction {eval_fraction:g} held out "
        f"{which} for eval (it holds out whole documents, and a .txt file is one); lower "
        "--eval-fraction (0: no eval split), give more documents (a .jsonl file holds one a "
        "line, or several files), or name held-out text with --eval-input"
    )


def publish(tmp: Path, output: Path, overwrite: bool) -> None:
    """Move the finished folder into place; a concurrent winner is kept, not clobbered."""
    if output.exists():
        check_output_folder(output)  # files may have appeared there while we prepared
        if overwrite:
            shutil.rmtree(output)
        elif (output / INFO_FILE).exists():
            shutil.rmtree(tmp)  # someone else finished the same dataset first
            return
        else:
            output.rmdir()  # empty
    output.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, output)
