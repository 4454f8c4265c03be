"""Issue 20 and 29 claims, measured: `python -m input_pipeline.prepare` runs in memory that does
not grow with the corpus (peak RSS of a 5 GB corpus within 1.3x of a 0.5 GB one) nor with its
number of file groups (80 files within 1.1x of 8 files of the same size), and its throughput
grows with the worker processes (1 vs 2, same run).

    python benchmarks/prepare.py [--sizes-gb 0.5 5] [--workers 1 2] [--file-mb 64] \\
        [--dir /tmp/prepare-bench] [--tokenizer byte|PATH.model] [--keep]
    python benchmarks/prepare.py --files 8 80 --file-mb 4.5 --workers 1 0 [--repeat 3]

For each size, generates a synthetic jsonl corpus of that many bytes (seeded random words, in
files of `--file-mb`), then prepares it once per worker count, as the CLI, in a fresh process.
Reports the wall time, MB/s of input text, tokens/s, and the peak RSS of the whole process tree
(prepare plus its workers, summed, polled from /proc every 0.1 s) and of its largest process
(the kernel's exact high-water mark, VmHWM, as last polled); first, the speedup plain busy loops
get from the same number of processes on this machine, the ceiling of the scaling on shared
cores.

`--files N ...` instead generates corpora of exactly N files of `--file-mb` each and reports the
peak RSS per file count, the number of groups prepare cut them into (`--group-mb`, default
prepare's), and the ratio of the largest count's peak to the smallest's: the median of
`--repeat` runs each. Workers 0 runs prepare's default (every core).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _repo_root  # noqa: F401  (before any project import: see its docstring)
import numpy as np

from benchmarks._cli import REPO_ROOT, non_negative_int, positive_int, run_main

WORDS = sorted(set(__doc__.split()))  # English-like words with code-like tokens mixed in


def generate(folder: Path, total_bytes: int, file_bytes: int, seed: int = 0) -> int:
    """Write ~`total_bytes` of jsonl documents (100 B to 20 kB of text each); return bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = text_pool(rng)
    written, index, file_number = 0, 0, 0
    while written < total_bytes:
        path = folder / f"part-{file_number:05d}.jsonl"
        index += write_file(path, min(file_bytes, total_bytes - written), rng, pool, index)
        written += path.stat().st_size
        file_number += 1
    return written


def generate_files(folder: Path, count: int, file_bytes: int, seed: int = 0) -> int:
    """Write exactly `count` jsonl files of ~`file_bytes` each (a block of 16 documents over);
    return bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = text_pool(rng)
    index = 0
    for number in range(count):
        index += write_file(folder / f"part-{number:05d}.jsonl", file_bytes, rng, pool, index, 16)
    return sum(p.stat().st_size for p in folder.glob("*.jsonl"))


def text_pool(rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, size=4_000_000))  # ~24 MB of text to cut documents from


def write_file(
    path: Path, limit: int, rng: np.random.Generator, pool: str, first: int, block: int = 512
) -> int:
    """Blocks of `block` documents numbered from `first` until `limit` bytes; return documents."""
    index = first
    with open(path, "w") as f:
        size = 0
        while size < limit:
            lengths = rng.integers(100, 20_000, block)
            starts = rng.integers(0, len(pool) - 20_000, block)
            lines = [
                json.dumps({"text": f"document {index + i}\n" + pool[s : s + n]}) + "\n"
                for i, (s, n) in enumerate(zip(starts, lengths, strict=True))
            ]
            index += len(lines)
            text = "".join(lines)
            f.write(text)
            size += len(text)
    return index - first


def tree_rss(pid: int) -> tuple[int, int]:
    """Summed RSS of `pid` and its descendants, and the largest high-water mark (VmHWM) among
    them (bytes): each process's own peak, exact up to the last poll before it exits."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(proc.name))
            rss[int(proc.name)] = int(fields[21]) * 4096
        except (OSError, IndexError, ValueError):
            continue
    todo, found = [pid], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return sum(rss.get(p, 0) for p in found), max(high_water_mark(p) for p in found)


def high_water_mark(pid: int) -> int:
    """A process's peak RSS so far (bytes), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def run_prepare(
    corpus: Path, output: Path, workers: int, tokenizer: str, group_mb: float | None = None
) -> dict[str, float]:
    """One prepare as the CLI, in a fresh process (`workers` 0: its default, every core)."""
    cmd = [
        sys.executable,
        "-m",
        "input_pipeline.prepare",
        "--input",
        str(corpus / "*.jsonl"),
        "--output",
        str(output),
        "--tokenizer",
        tokenizer,
        "--overwrite",
        "--no-progress",
        *(["--workers", str(workers)] if workers else []),
        *(["--group-mb", str(group_mb)] if group_mb else []),
    ]
    start = time.perf_counter()
    # in the caller's folder, where --dir and --tokenizer name their paths: this checkout's code
    proc = subprocess.Popen(cmd, env=with_repo_on_path(), stderr=subprocess.PIPE, text=True)
    peak_sum = peak_one = 0
    while proc.poll() is None:
        total, largest = tree_rss(proc.pid)
        peak_sum, peak_one = max(peak_sum, total), max(peak_one, largest)
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    if proc.returncode:  # its own line (exit 2: a user's mistake, such as a missing tokenizer)
        print(f"prepare failed: {proc.stderr.read().strip()[-2000:]}", file=sys.stderr)
        raise SystemExit(proc.returncode)
    info = json.loads((output / "dataset.json").read_text())
    tokens = sum(split["tokens"] for split in info["splits"].values())
    return {"seconds": seconds, "tokens": tokens, "peak_rss": peak_sum, "peak_one": peak_one}


def with_repo_on_path() -> dict[str, str]:
    """The environment with this checkout first on PYTHONPATH: `python -m input_pipeline.prepare`
    runs its code from whatever folder it is started in."""
    paths = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


BURN = "total = 0\nfor i in range({n}): total += i"


def cpu_parallelism(processes: int = 2, n: int = 30_000_000) -> float:
    """How much faster `processes` busy processes finish `processes` fixed loops than one does:
    the parallelism this (possibly shared) machine really gives, to read the scaling against."""

    def burn(count: int) -> float:
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", BURN.format(n=n)]) for _ in range(count)]
        for proc in procs:
            proc.wait()
        return time.perf_counter() - start

    return processes * burn(1) / burn(processes)


def sizes_table(args: argparse.Namespace, root: Path) -> None:
    """Issue 20: throughput and peak RSS per corpus size and worker count."""
    most = max(args.workers)
    print(f"pure-CPU speedup of {most} processes here: {cpu_parallelism(most):.2f}x", flush=True)
    print("size_gb  workers  wall_s  MB/s  Mtokens/s  peak_rss_MB  largest_process_MB")
    for size in args.sizes_gb:
        corpus = root / f"corpus-{size:g}gb"
        if not corpus.exists():
            generate(corpus, int(size * 1e9), int(args.file_mb * 2**20))
        text_bytes = sum(p.stat().st_size for p in corpus.glob("*.jsonl"))
        for workers in args.workers:
            out = root / f"dataset-{size:g}gb-w{workers}"
            r = run_prepare(corpus, out, workers, args.tokenizer, args.group_mb)
            print(
                f"{size:7g}  {workers:7d}  {r['seconds']:6.1f}  "
                f"{text_bytes / 1e6 / r['seconds']:4.1f}  {r['tokens'] / 1e6 / r['seconds']:9.2f}  "
                f"{r['peak_rss'] / 2**20:11.0f}  {r['peak_one'] / 2**20:18.0f}",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(corpus, ignore_errors=True)


def files_table(args: argparse.Namespace, root: Path) -> None:
    """Issue 29: peak RSS per number of files (and so of groups), and its growth."""
    from input_pipeline.documents import plan_groups
    from input_pipeline.prepare import DEFAULT_GROUP_MB

    group_mb = args.group_mb or DEFAULT_GROUP_MB
    print(f"median of {args.repeat} run(s); groups of {group_mb:g} MB; workers 0: every core")
    print("files  input_MB  groups  workers  wall_s  peak_rss_MB  largest_process_MB")
    peaks: dict[int, dict[int, tuple[float, float]]] = {w: {} for w in args.workers}
    for count in args.files:
        corpus = root / f"files-{count}x{args.file_mb:g}mb"
        if not corpus.exists():
            generate_files(corpus, count, int(args.file_mb * 2**20))
        paths = sorted(corpus.glob("*.jsonl"))
        groups = len(plan_groups(paths, [], int(group_mb * 2**20)))
        text_mb = sum(p.stat().st_size for p in paths) / 2**20
        for workers in args.workers:
            out = root / f"dataset-files-{count}-w{workers}"
            runs = [
                run_prepare(corpus, out, workers, args.tokenizer, args.group_mb)
                for _ in range(args.repeat)
            ]
            wall, tree, one = (
                statistics.median(r[key] for r in runs)
                for key in ("seconds", "peak_rss", "peak_one")
            )
            peaks[workers][count] = (tree, one)
            print(
                f"{count:5d}  {text_mb:8.1f}  {groups:6d}  {workers:7d}  {wall:6.1f}  "
                f"{tree / 2**20:11.0f}  {one / 2**20:18.0f}",
                flush=True,
            )
            shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(corpus, ignore_errors=True)
    low, high = min(args.files), max(args.files)
    for workers, by_count in peaks.items():
        (tree_low, one_low), (tree_high, one_high) = by_count[low], by_count[high]
        print(
            f"workers {workers}: peak RSS of {high} files over {low}: "
            f"{tree_high / tree_low:.2f}x (tree), {one_high / one_low:.2f}x (largest process)"
        )


def positive_float(text: str) -> float:
    """An argparse type for a size in GB or MB: above zero."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a size above 0")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gb", type=positive_float, nargs="+", default=[0.5, 5.0])
    parser.add_argument(
        "--files", type=positive_int, nargs="+", help="file counts to compare instead"
    )
    parser.add_argument(
        "--workers", type=non_negative_int, nargs="+", default=[1, 2], help="0: prepare's default"
    )
    parser.add_argument(
        "--file-mb", type=positive_float, default=64.0, help="size of each input file"
    )
    parser.add_argument(
        "--group-mb", type=positive_float, help="prepare's --group-mb (default: its own)"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=1, help="--files runs per point (median)"
    )
    parser.add_argument("--dir", default="/tmp/prepare-bench", help="scratch folder")
    parser.add_argument("--tokenizer", default="byte", help="byte, or a SentencePiece .model")
    parser.add_argument("--keep", action="store_true", help="keep the corpora and datasets")
    args = parser.parse_args()
    if args.files:
        files_table(args, Path(args.dir))
    else:
        sizes_table(args, Path(args.dir))


if __name__ == "__main__":
    sys.exit(run_main(main))
