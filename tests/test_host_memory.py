"""The entry points restart with glibc's huge-page tunable, in place, and malloc then uses it."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.host_memory import OPT_OUT, TUNABLE, huge_page_environment, is_glibc

linux_glibc = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and is_glibc()), reason="glibc tunables only"
)


@linux_glibc
def test_environment_adds_the_tunable_and_keeps_the_users():
    assert huge_page_environment({})["GLIBC_TUNABLES"] == TUNABLE
    mine = huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
    assert mine["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}"
    assert mine["X"] == "1"


@linux_glibc
def test_environment_is_left_alone_when_set_or_opted_out():
    assert huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
    assert huge_page_environment({"GLIBC_TUNABLES": TUNABLE}) is None
    assert huge_page_environment({OPT_OUT: "0"}) is None


def transparent_huge_pages_off() -> bool:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return not setting.exists() or "[never]" in setting.read_text()


PROBE = textwrap.dedent(
    """
    import ctypes, os
    print("pid", os.getpid(), flush=True)
    from trainer.host_memory import restart_with_huge_pages
    restart_with_huge_pages()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    size = 256 << 20  # a malloc block well above the mmap threshold (numpy advises on its own)
    block = libc.malloc(ctypes.c_size_t(size))
    ctypes.memset(block, 1, size)
    rollup = open("/proc/self/smaps_rollup").read().splitlines()
    huge_kb = next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages"))
    print("tunables", os.environ.get("GLIBC_TUNABLES"))
    print("huge_kb", huge_kb)
    """
)


def run_probe(repo_root: Path, env_extra: dict) -> dict[str, list[str]]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo_root), **env_extra}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=repo_root, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    lines: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        key, value = line.split(" ", 1)
        lines.setdefault(key, []).append(value)
    return lines


@linux_glibc
def test_restart_is_in_place_and_malloc_maps_huge_pages(repo_root):
    seen = run_probe(repo_root, {})
    assert len(set(seen["pid"])) == 1 and len(seen["pid"]) == 2  # printed before and after
    assert seen["tunables"] == [TUNABLE]
    if transparent_huge_pages_off():
        pytest.skip("this kernel's transparent huge pages are off")
    assert int(seen["huge_kb"][0]) >= 128 << 10  # most of the 256 MiB block
    plain = run_probe(repo_root, {OPT_OUT: "0"})
    assert len(plain["pid"]) == 1 and plain["tunables"] == ["None"]
    assert int(plain["huge_kb"][0]) < 32 << 10


def test_the_restart_comes_before_jax_is_imported(repo_root):
    """`python -m trainer.main` imports the `trainer` package before it can restart: a heavy
    import there (JAX and Flax take ~1.3 s) would be paid twice by every CLI start."""
    probe = "import sys, trainer.host_memory; print(sorted({'jax', 'flax'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=repo_root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
