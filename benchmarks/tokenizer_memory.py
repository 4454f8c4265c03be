"""Peak memory of the `hf:` tokenizer on one long document: encoded whole (as before) against
encoded in pieces (`HFTokenizer`'s default where the tokenizer's splitting allows it).

Each case runs in a fresh process, so its peak resident size is its own: the text (every stdlib
`.py` file, repeated to the size asked) is built and encoded once to warm up, then the growth of
the peak (`ru_maxrss`) over one `encode` of the whole text is printed, with the bytes per token.
Both ways must give the same ids; the script checks it.

    python benchmarks/tokenizer_memory.py [--mib 5 20] \
        [--tokenizer tests/fixtures/hf_tiny_llama/tokenizer.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import sysconfig
from pathlib import Path

import _repo_root  # noqa: F401  (before any project import: see its docstring)

from benchmarks._cli import positive_int, repo_file, run_main
from input_pipeline.tokenizers import HFTokenizer

WAYS = ("whole", "pieces")


def long_text(mib: int) -> str:
    """About `mib` MiB of real text: the standard library's `.py` files, repeated."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    stdlib = "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in files)
    return (stdlib * (mib * 2**20 // len(stdlib) + 1))[: mib * 2**20]


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def one_case(tokenizer_file: str, mib: int, way: str) -> dict[str, float | int | str]:
    """This process's peak growth over encoding `mib` MiB one `way`."""
    tokenizer = HFTokenizer(tokenizer_file)
    if way == "whole":
        tokenizer.piece_chars = None
    text = long_text(mib)
    tokenizer.encode(text[: 2**16])  # the library's own start-up, not counted
    before = peak_mib()
    ids = tokenizer.encode(text)
    growth = peak_mib() - before
    return {
        "way": way,
        "mib": mib,
        "tokens": len(ids),
        "growth_mib": round(growth, 1),
        "bytes_per_token": round(growth * 2**20 / len(ids), 1),
        "ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=positive_int, nargs="+", default=[5, 20])
    parser.add_argument(
        "--tokenizer", default=repo_file("tests/fixtures/hf_tiny_llama/tokenizer.json")
    )
    parser.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)  # a child's own case
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_case(args.tokenizer, args.mib[0], args.one)))
        return
    print(
        f"{'MiB':>4} {'tokens':>11} {'whole MiB':>10} {'B/token':>8} {'pieces MiB':>11} "
        f"{'B/token':>8} {'ratio':>6}"
    )
    for mib in args.mib:
        cases = {}
        for way in WAYS:
            command = [sys.executable, __file__, "--one", way, "--mib", str(mib)]
            child = subprocess.run(
                [*command, "--tokenizer", args.tokenizer],
                capture_output=True,
                text=True,
                check=True,
            )
            cases[way] = json.loads(child.stdout.splitlines()[-1])
        whole, pieces = cases["whole"], cases["pieces"]
        if whole["ids_sha256"] != pieces["ids_sha256"]:
            raise SystemExit(f"{mib} MiB: the pieces' ids differ from the whole text's")
        print(
            f"{mib:>4} {whole['tokens']:>11,} {whole['growth_mib']:>10} "
            f"{whole['bytes_per_token']:>8} {pieces['growth_mib']:>11} "
            f"{pieces['bytes_per_token']:>8} {pieces['growth_mib'] / whole['growth_mib']:>6.2f}"
        )


if __name__ == "__main__":
    sys.exit(run_main(main))
