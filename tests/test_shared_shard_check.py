"""Processes that read the same shards on shared storage hash each shard once among them: every
host hashed every shard before the first step, so 4 hosts over 240 GB on NFS each read all of it
(hours of idle accelerators). A shard that does not match still stops every process, with one
line naming it, whichever process hashed it; hosts with their own copies each check their own."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import flipped_copy
from test_multihost import on_two_hosts, on_two_joined_processes, started_on_two_hosts
from test_verified_shards import prepare_small, touch

from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.verified import check_line, record_file, shards_to_hash, shared_stamp, size_text

# ----------------------------------------------------------------------------- the decision


def stamps(*sizes: int, processes: int = 2) -> np.ndarray:
    """Every process's `shared_stamp` of shards of `sizes`, all alike: one shared file each."""
    one = [(1000 + shard, size, 7, 8) for shard, size in enumerate(sizes)]
    return np.array([one] * processes, np.int64)


def shares(stamps_PxSx4: np.ndarray, unchecked_PxS: np.ndarray) -> list[list[int]]:
    return [shards_to_hash(stamps_PxSx4, unchecked_PxS, me)[1] for me in range(len(stamps_PxSx4))]


def test_shared_shards_are_split_among_the_processes_by_size():
    everyone = stamps(300, 100, 100, 100, 50, 50)
    shared, _ = shards_to_hash(everyone, np.ones((2, 6), bool), 0)
    assert shared.tolist() == [True] * 6
    assert shares(everyone, np.ones((2, 6), bool)) == [[0, 4], [1, 2, 3, 5]]  # 350 and 350 bytes
    assert shares(stamps(5, 5, 5, 5, processes=3), np.ones((3, 4), bool)) == [[0, 3], [1], [2]]


def test_a_shard_every_process_has_checked_is_not_hashed_and_one_any_lacks_is_hashed_once():
    unchecked = np.array([[False, True, False, False], [False, False, True, False]])
    assert shares(stamps(10, 10, 10, 10), unchecked) == [[1], [2]]
    assert shares(stamps(10, 10, 10, 10), np.zeros((2, 4), bool)) == [[], []]


def test_a_shard_that_differs_on_any_process_is_hashed_by_each_in_its_own_copy():
    """Another inode, size or time on one process: copies, not one shared file."""
    for field in range(4):
        everyone = stamps(10, 10, 10)
        everyone[1, 2, field] += 1
        shared, _ = shards_to_hash(everyone, np.ones((2, 3), bool), 0)
        assert shared.tolist() == [True, True, False], field
        assert shares(everyone, np.ones((2, 3), bool)) == [[0, 2], [1, 2]], field
        unchecked = np.array([[True, True, False], [True, True, True]])
        assert shares(everyone, unchecked) == [[0], [1, 2]], field


def test_the_shared_stamp_leaves_out_the_device_and_tells_a_copy_from_the_file(corpus, tmp_path):
    """The device number is each mount's own; a copy, even with the same times, is another file
    (its inode number and change time)."""
    shard = next(corpus.glob("train-*"))
    st = shard.stat()
    assert shared_stamp(shard) == (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    copy = Path(shutil.copy2(shard, tmp_path / shard.name))
    assert shared_stamp(copy)[1:3] == shared_stamp(shard)[1:3]
    assert shared_stamp(copy) != shared_stamp(shard)


# ----------------------------------------------------------------------------- the line before

ONCE = (
    "; a one-time check: later starts skip the shards that pass it and are unchanged since "
    "(data.verify_checksums=false turns it off)"
)


def test_the_line_before_the_check_says_what_is_read_once_by_whom_and_how_to_skip_it():
    """4 hosts over 40 shards of 11.8 GB on NFS read for about an hour before the first step,
    without a word. One line now says it for every process; a restart that knows every shard
    says nothing."""
    everyone = stamps(*[11_800_000_000] * 40, processes=4)
    assert check_line(everyone, np.ones((4, 40), bool)) == (
        f"checking the sha256 of 40 shards (472.0 GB) before training, split over 4 processes{ONCE}"
    )
    assert check_line(everyone, np.zeros((4, 40), bool)) is None
    one_lacks_one = np.zeros((4, 40), bool)
    one_lacks_one[2, 7] = True  # a host whose record was lost: the least loaded process reads it
    assert check_line(everyone, one_lacks_one) == (
        f"checking the sha256 of 1 shard (11.8 GB) before training, all by process 0 of 4{ONCE}"
    )
    assert check_line(everyone[:1], np.ones((1, 40), bool)) == (
        f"checking the sha256 of 40 shards (472.0 GB) before training{ONCE}"
    )


def test_the_line_before_the_check_counts_each_hosts_own_copies():
    """Hosts with their own copies each read all of theirs: the wait is the most any one
    process reads, not the total over the processes."""
    everyone = stamps(*[100_000_000] * 10, processes=2)
    everyone[1, 6:, 3] += 1  # the last 4 shards: each host's own copy
    assert check_line(everyone, np.ones((2, 10), bool)) == (
        "checking the sha256 of 14 shards (1.4 GB, each process's own copies counted apart) "
        f"before training, by 2 processes, up to 700.0 MB on one{ONCE}"
    )


@pytest.mark.parametrize(
    "size, said",
    [(0, "0 bytes"), (999, "999 bytes"), (1000, "1.0 kB"), (1_849_000, "1.8 MB")]
    + [(118_000_000_000, "118.0 GB"), (1_888_000_000_000, "1.9 TB")],
)
def test_sizes_are_said_in_decimal_units(size, said):
    assert size_text(size) == said


# ----------------------------------------------------------------------------- two processes

CHECK_TOGETHER = """
import contextlib
import os
import sys
import threading

import input_pipeline.dataset_info
import trainer.data
from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.parallel.distributed import cluster_from_env, initialize

said, caches, *datasets = sys.argv[1:]
said = open(said, "w", buffering=1)  # stdout also carries Gloo's lines
initialize(cluster_from_env())
real_sha256_of, one_line_at_a_time = input_pipeline.dataset_info.sha256_of, threading.Lock()


def said_and_hashed(path):  # called on the check's threads
    with one_line_at_a_time:
        print(f"hashed {path.name}", file=said)
    return real_sha256_of(path)


input_pipeline.dataset_info.sha256_of = said_and_hashed
for dataset in datasets:
    name = os.path.basename(dataset)
    data = load_config(None, [f"data.path={dataset}", f"data.cache_dir={caches}/{name}"]).data
    print(f"check {name}", file=said)
    try:
        with contextlib.redirect_stderr(said):  # the line before the check
            infos = [load_dataset_info(dataset)]
            trainer.data.verify_shards(data, infos, ("data.path", name))
        print("passed", file=said)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=said)
"""


def all_shards(dataset: Path) -> list[Path]:
    return [path for path, _ in load_dataset_info(dataset).checksums()]


def shard_hashed_by(process: int, dataset: Path) -> Path:
    """A shard that `process` of 2 hashes, as a first start of both (nothing recorded) splits
    the shards of `dataset`."""
    paths = all_shards(dataset)
    stamps_1xSx4 = np.array([[shared_stamp(path) for path in paths]], np.int64)
    everyone = np.concatenate([stamps_1xSx4] * 2)
    return paths[shards_to_hash(everyone, np.ones((2, len(paths)), bool), process)[1][0]]


def checks_of(said: Path) -> list[tuple[str, set[str], list[str]]]:
    """For each check a process made in turn: the dataset, the shards it hashed, what it said."""
    checks: list[tuple[str, set[str], list[str]]] = []
    for line in said.read_text().splitlines():
        if line.startswith("check "):
            checks.append((line.removeprefix("check "), set(), []))
        elif line.startswith("hashed "):
            checks[-1][1].add(line.removeprefix("hashed "))
        else:
            checks[-1][2].append(line)
    return checks


def said_first(dataset: Path, own_copies: bool = False) -> str:
    """The line process 0 of 2 says before a first start of both checks `dataset` (a few MB):
    one copy on storage they share, or each its own (`own_copies`)."""
    size = sum(path.stat().st_size for path in all_shards(dataset))
    if not own_copies:
        return (
            f"checking the sha256 of {len(all_shards(dataset))} shards ({size / 1e6:.1f} MB) "
            f"before training, split over 2 processes{ONCE}"
        )
    return (
        f"checking the sha256 of {2 * len(all_shards(dataset))} shards ({2 * size / 1e6:.1f} MB, "
        "each process's own copies counted apart) before training, by 2 processes, up "
        f"to {size / 1e6:.1f} MB on one{ONCE}"
    )


def recorded(caches: Path, dataset: Path, process: int) -> set[str]:
    """The shards a process's record (`VerifiedShards`) says matched."""
    entries = json.loads(record_file(caches / dataset.name, process).read_text())
    return {Path(path).name for path in entries}


def test_processes_sharing_the_shards_hash_each_once_and_both_stop_on_a_damaged_one(
    corpus, tmp_path, repo_root
):
    """A first start of both processes on one shared dataset: process 0 says in one line what
    they read, each hashes its share, and both record every shard; again, nothing is hashed and
    nothing said. A damaged shard, whichever process hashed it, is one line on both. Copies of
    their own (another inode each): each hashes all of its own."""
    shared = Path(shutil.copytree(corpus, tmp_path / "shared"))
    damaged = [tmp_path / f"damaged-by-{process}" for process in range(2)]
    for process, copy in enumerate(damaged):
        flipped_copy(corpus, copy, shard_hashed_by(process, corpus).name)
    own = [Path(shutil.copytree(corpus, tmp_path / f"own{p}" / "own")) for p in range(2)]
    script, said = tmp_path / "check.py", [tmp_path / f"said{p}.txt" for p in range(2)]
    script.write_text(CHECK_TOGETHER)
    caches = [tmp_path / f"caches{p}" for p in range(2)]
    datasets = [shared, shared, *damaged]
    statuses, printed = on_two_joined_processes(
        repo_root,
        [
            [str(script), str(said[p]), str(caches[p]), *map(str, [*datasets, own[p]])]
            for p in (0, 1)
        ],
        devices=1,
    )
    assert statuses == [0, 0], printed
    (first_0, again_0, *damaged_0, own_0), (first_1, again_1, *damaged_1, own_1) = map(
        checks_of, said
    )
    names = {path.name for path in all_shards(shared)}

    assert first_0[2] == [said_first(shared), "passed"]
    assert first_1[2] == ["passed"]
    assert first_0[1] and first_1[1] and not first_0[1] & first_1[1], (first_0, first_1)
    assert first_0[1] | first_1[1] == names
    assert recorded(caches[0], shared, 0) == recorded(caches[1], shared, 1) == names
    assert again_0 == again_1 == ("shared", set(), ["passed"])

    for process, (copy, said_0, said_1) in enumerate(
        zip(damaged, damaged_0, damaged_1, strict=True)
    ):
        shard = shard_hashed_by(process, corpus).name
        line = load_dataset_info(copy).mismatch(copy / shard)
        assert said_0[2] == [said_first(copy), f"error: {line}"], said_0
        assert said_1[2] == [f"error: {line}"], said_1
        assert [shard in said_0[1], shard in said_1[1]] == [process == 0, process == 1]
        assert recorded(caches[0], copy, 0) == recorded(caches[1], copy, 1) == names - {shard}

    assert own_0[1] == own_1[1] == names
    assert own_0[2] == [said_first(own[0], own_copies=True), "passed"]
    assert own_1[2] == ["passed"]


def test_processes_started_after_prepare_hash_no_shard_it_left_unchanged(tmp_path, repo_root):
    """Both processes of a first start on a dataset just prepared on their shared storage: each
    finds every shard with the stamp prepare recorded, so nothing is read and nothing said. A
    shard touched since is hashed once, by one of them."""
    fresh, touched = (prepare_small(tmp_path / name) for name in ("fresh", "touched"))
    shard = all_shards(touched)[0]
    touch(shard)
    script, said = tmp_path / "check.py", [tmp_path / f"said{p}.txt" for p in range(2)]
    script.write_text(CHECK_TOGETHER)
    statuses, printed = on_two_joined_processes(
        repo_root,
        [
            [str(script), str(said[p]), str(tmp_path / f"caches{p}"), str(fresh), str(touched)]
            for p in (0, 1)
        ],
        devices=1,
    )
    assert statuses == [0, 0], printed
    (fresh_0, touched_0), (fresh_1, touched_1) = map(checks_of, said)
    assert fresh_0 == fresh_1 == ("fresh", set(), ["passed"])
    assert touched_0[1] | touched_1[1] == {shard.name}, (touched_0, touched_1)
    assert not touched_0[1] & touched_1[1]
    size = f"{shard.stat().st_size / 1e3:.1f} kB"
    assert touched_0[2][0].startswith(f"checking the sha256 of 1 shard ({size}) before training")
    assert touched_0[2][1:] == touched_1[2] == ["passed"]


def test_a_damaged_shared_shard_stops_both_runs_with_one_line(tmp_path, corpus, repo_root):
    """Through `python -m trainer.main`: the shard process 1 hashes is damaged (a first start:
    nothing recorded), and process 0, which never read it, stops with the same line (exit 2),
    after its line saying what both read. Both record the shards that matched, so a rerun once
    it is restored hashes only that one."""
    copy, shard = flipped_copy(corpus, tmp_path / "damaged", shard_hashed_by(1, corpus).name)
    with started_on_two_hosts(tmp_path, repo_root, [copy, copy], "data.cache_dir=cache") as procs:
        said = [proc.communicate(timeout=120)[1] for proc in procs]
    line = (
        f"error: shard data/{shard.name} does not match the checksum in data/dataset.json "
        "(changed or damaged since prepare); restore it or re-run python -m "
        "input_pipeline.prepare --overwrite (data.verify_checksums=false skips this)"
    )
    for proc, stderr, before in zip(procs, said, [[said_first(copy)], []], strict=True):
        assert proc.returncode == 2, stderr[-3000:]
        assert stderr.splitlines()[1:] == [*before, line], stderr[-3000:]
    names = {path.name for path in all_shards(copy)} - {shard.name}
    for host in range(2):
        entries = json.loads(record_file(tmp_path / f"host{host}" / "cache", host).read_text())
        assert {Path(path).name for path in entries} == names


def test_a_shard_missing_on_one_host_stops_both_as_the_data_opens(tmp_path, corpus, repo_root):
    """Each process lists its shards while its data opens, before the check they share: one
    whose copy lacks a shard says so, and the other names it, as for any data that does not
    open (a missing shard found inside the shared check left the other waiting there)."""
    copy = Path(shutil.copytree(corpus, tmp_path / "incomplete"))
    shard = sorted(copy.glob("train-*"))[1]
    shard.unlink()
    (status_0, said_0), (status_1, said_1) = on_two_hosts(tmp_path, repo_root, [corpus, copy])
    assert (status_0, status_1) == (2, 2), said_0[-3000:] + said_1[-3000:]
    assert said_0.splitlines()[1:] == [
        "error: process 1 could not open its data at data.path=data (its own log says why); "
        "repair that host's copy, or point data.path at storage every host mounts (NFS, "
        "Lustre, ...)"
    ], said_0[-3000:]
    assert said_1.splitlines()[1:] == [
        f"error: shard data/{shard.name} listed in data/dataset.json is missing; restore it or "
        "re-run python -m input_pipeline.prepare --overwrite"
    ], said_1[-3000:]
