"""Issue 20 claims, measured: `python -m input_pipeline.prepare` runs in memory that does not grow
with the corpus (peak RSS of a 5 GB corpus within 1.3x of a 0.5 GB one), and its throughput
grows with the worker processes (1 vs 2, same run).

    python benchmarks/prepare.py [--sizes-gb 0.5 5] [--workers 1 2] [--file-mb 64] \\
        [--dir /tmp/prepare-bench] [--tokenizer byte|PATH.model] [--keep]

For each size, generates a synthetic jsonl corpus of that many bytes (seeded random words, in
files of `--file-mb`), then prepares it once per worker count, as the CLI, in a fresh process.
Reports the wall time, MB/s of input text, tokens/s, and the peak RSS of the whole process tree
(prepare plus its workers, summed, polled from /proc every 0.1 s) and of its largest process;
first, the speedup plain busy loops get from the same number of processes on this machine, the
ceiling of the scaling on shared cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _repo_root  # noqa: F401  (before any project import: see its docstring)
import numpy as np

WORDS = sorted(set(__doc__.split()))  # English-like words with code-like tokens mixed in


def generate(folder: Path, total_bytes: int, file_bytes: int, seed: int = 0) -> int:
    """Write ~`total_bytes` of jsonl documents (100 B to 20 kB of text each); return bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = " ".join(rng.choice(WORDS, size=4_000_000))  # ~24 MB of text to cut documents from
    written, index, file_number = 0, 0, 0
    while written < total_bytes:
        path = folder / f"part-{file_number:05d}.jsonl"
        with open(path, "w") as f:
            size = 0
            while size < file_bytes and written + size < total_bytes:
                lengths = rng.integers(100, 20_000, 512)
                starts = rng.integers(0, len(pool) - 20_000, 512)
                lines = [
                    json.dumps({"text": f"document {index + i}\n" + pool[s : s + n]}) + "\n"
                    for i, (s, n) in enumerate(zip(starts, lengths, strict=True))
                ]
                index += len(lines)
                block = "".join(lines)
                f.write(block)
                size += len(block)
        written += path.stat().st_size
        file_number += 1
    return written


def tree_rss(pid: int) -> tuple[int, int]:
    """Summed and largest RSS (bytes) of `pid` and its descendants."""
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
    sizes = [rss.get(p, 0) for p in found]
    return sum(sizes), max(sizes)


def run_prepare(corpus: Path, output: Path, workers: int, tokenizer: str) -> dict[str, float]:
    cmd = [
        sys.executable,
        "-m",
        "input_pipeline.prepare",
        "--input",
        str(corpus / "*.jsonl"),
        "--output",
        str(output),
        "--workers",
        str(workers),
        "--tokenizer",
        tokenizer,
        "--overwrite",
        "--no-progress",
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE, text=True
    )
    peak_sum = peak_one = 0
    while proc.poll() is None:
        total, largest = tree_rss(proc.pid)
        peak_sum, peak_one = max(peak_sum, total), max(peak_one, largest)
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    info = json.loads((output / "dataset.json").read_text())
    tokens = sum(split["tokens"] for split in info["splits"].values())
    return {"seconds": seconds, "tokens": tokens, "peak_rss": peak_sum, "peak_one": peak_one}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.5, 5.0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--file-mb", type=float, default=64.0, help="size of each input file")
    parser.add_argument("--dir", default="/tmp/prepare-bench", help="scratch folder")
    parser.add_argument("--tokenizer", default="byte", help="byte, or a SentencePiece .model")
    parser.add_argument("--keep", action="store_true", help="keep the corpora and datasets")
    args = parser.parse_args()
    root = Path(args.dir)
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
            r = run_prepare(corpus, out, workers, args.tokenizer)
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


if __name__ == "__main__":
    main()
