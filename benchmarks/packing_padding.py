"""Issue 26 claim: bounding the documents per packed row (`data.max_docs_per_row`, which the
packed-document attention kernel needs) adds under 1% padding at the default.

For each corpus, packing and `seq_len`, one shuffled pass (seed 0) over the train split through
the real chain (`make_batch_iterator`, records from RAM) per bound M, printing the share of the
slots of non-empty rows that are padding; `inf` is no bound, and the bound's cost is the
difference. Corpora, both byte tokens:
  python-stdlib  the built-in corpus (every stdlib `.py` file, one document each);
  sentences      a corpus of short documents: the stdlib's docstrings cut into sentences of
                 20-200 bytes (21k documents, median 61 tokens), one document each;
  or any folder `python -m input_pipeline.prepare` wrote, to choose a bound for your data.

    python benchmarks/packing_padding.py [--seq-lens 256 1024 2048] [--bounds 2 4 8 ...]
        [--packings concat first_fit] [--corpora python-stdlib sentences] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import _repo_root  # noqa: F401  (before any project import: see its docstring)
from absl import flags

from benchmarks._cli import positive_int, run_main
from input_pipeline.corpora import default_cache_dir, python_docstring_documents, resolve_dataset
from input_pipeline.dataset_info import INFO_FILE, DatasetInfo, load_dataset_info
from input_pipeline.pipeline import make_batch_iterator, memory_source
from input_pipeline.prepare import prepare_dataset
from input_pipeline.reading import Reading
from trainer.config import DataConfig

SHORT = (20, 200)  # bytes (= tokens) of a short document


def sentences() -> list[str]:
    """The stdlib's docstrings cut at paragraph and sentence ends, whitespace collapsed; the
    pieces of 20-200 bytes, one short document each."""
    found = []
    for text in python_docstring_documents():
        for paragraph in re.split(r"\n\s*\n", text):
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
                if SHORT[0] <= len(sentence.encode()) <= SHORT[1]:
                    found.append(sentence)
    return found


def corpus(name: str, cache_dir: Path) -> DatasetInfo:
    """A prepared corpus: `sentences` (prepared once here), a built-in one by name, or any
    prepared dataset folder."""
    if name != "sentences":
        return load_dataset_info(resolve_dataset(name, cache_dir))
    folder = cache_dir / "docstring-sentences-byte"
    if not (folder / INFO_FILE).exists():
        print(f"preparing {folder} (first use only)", file=sys.stderr)
        prepare_dataset(sentences(), folder, eval_fraction=0.01, progress=False)
    return load_dataset_info(folder)


def padding(info: DatasetInfo, source, seq_len: int, batch_size: int, packing: str, bound):
    """The share of the slots of rows holding any real token that are padding, over one
    shuffled pass of the train split; and the most documents found in one row."""
    batches = make_batch_iterator(
        info,
        "train",
        seq_len=seq_len,
        batch_size=batch_size,
        packing=packing,
        reading=Reading(seed=0, num_epochs=1),
        source=source,
        max_docs_per_row=bound,
    )
    real = rows = most = 0
    for batch in batches:
        weights = batch["weights"]
        used = weights.any(axis=1)
        real += int(weights.sum())
        rows += int(used.sum())
        most = max(most, int(batch["segment_ids"].max()))
    return 1.0 - real / (rows * seq_len), most


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=positive_int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument(
        "--bounds",
        type=positive_int,
        nargs="+",
        default=[2, 4, 6, 8, 16, 18, 20, 24, 32, 34, 36, 40, 64],
    )
    parser.add_argument(
        "--packings", nargs="+", choices=["concat", "first_fit"], default=["concat", "first_fit"]
    )
    parser.add_argument(
        "--corpora",
        nargs="+",
        default=["python-stdlib", "sentences"],
        help="python-stdlib, sentences, or prepared dataset folders",
    )
    parser.add_argument("--batch-size", type=positive_int, default=32, help="rows per batch (bins)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: built-ins' cache")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    flags.FLAGS.mark_as_parsed()  # Grain reads absl flags
    cache = args.cache_dir or default_cache_dir()
    print("padding % of the slots of non-empty rows; docs = most documents in a row, unbounded")
    print(
        "| corpus | packing | seq_len | auto M | "
        + " | ".join(f"M={m}" for m in [*args.bounds, "inf"])
        + " | docs |"
    )
    print("|---" * (len(args.bounds) + 6) + "|")
    for name in args.corpora:
        info = corpus(name, cache)
        source = memory_source(info, "train", Reading())
        for packing in args.packings:
            for seq_len in args.seq_lens:
                auto = DataConfig(seq_len=seq_len).resolved_max_docs_per_row
                cells, most = [], 0
                for bound in [*args.bounds, None]:
                    share, most = padding(info, source, seq_len, args.batch_size, packing, bound)
                    cells.append(f"{100 * share:.2f}")
                print(
                    f"| {name} | {packing} | {seq_len} | {auto} | {' | '.join(cells)} | {most} |",
                    flush=True,
                )


if __name__ == "__main__":
    sys.exit(run_main(main))
