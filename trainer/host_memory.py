"""Huge pages for the host's large malloc blocks, set before the process starts.

On CPU, every XLA step allocates its temporaries (1.1 GB for the 125m preset) with
`posix_memalign`, which glibc serves with a fresh `mmap` and hands back with `munmap` when the
step ends, so the next step faults every 4 KiB page in again: 271k faults, ~0.4 s of kernel time
in a 1.4 s step. Those faults also compete with a background checkpoint write for the same free
memory, which made the steps that overlap a save up to 1.5x slower. glibc's
`glibc.malloc.hugetlb=1` tunable makes malloc `madvise(MADV_HUGEPAGE)` its large blocks, so the
kernel maps them with 2 MiB pages: 1-2k faults per step and a ~15-20% faster 125m step. The
steps that overlap a save are slowed less too, though not yet within 1.1x (BENCHMARKS.md).

glibc reads tunables once, when the process starts, so `python -m trainer.main` and the
benchmarks re-execute themselves (same PID, same arguments) with the tunable added to
`GLIBC_TUNABLES`. `TRAINER_HUGE_PAGES=0` keeps glibc's defaults. Nothing changes off glibc, or
where the kernel's transparent huge pages are set to `never` (the advice is then ignored).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "TRAINER_HUGE_PAGES"  # "0": leave malloc as it is


def is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # not a glibc system
        return False


def huge_page_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to restart with, or None when the current one already fits."""
    if not sys.platform.startswith("linux") or not is_glibc() or environ.get(OPT_OUT) == "0":
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:  # set already, by us or by the user
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    return env


def restart_with_huge_pages() -> None:
    """Re-execute this interpreter with `TUNABLE` set, unless it is set already.

    Call it first thing in a script's entry point, never from a library call: `os.execve`
    replaces the running program (the PID stays, so launchers and signals still reach it)."""
    env = huge_page_environment(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
