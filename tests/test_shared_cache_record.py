"""Hosts whose cache folder is one shared home folder keep their records of checked shards apart,
and find them again on another node: one record file, saved whole by every host with stamps
carrying each host's own device number for the NFS mount, left every host but the last writer
none of its shards known, so every Slurm requeue read the whole dataset again before its first
step.

Two processes here stand for two hosts as NFS makes them: each in its own mount namespace sees
one ext4 image at the same path through its own loop device (same inodes and times, another
device number, as each NFS client numbers its mount), and its own copy of the data bind-mounted
at one path (host-local copies). A restart swaps the loop devices, as a requeue onto other nodes
does. Needs root and loop devices; skipped elsewhere."""

import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_multihost import cpu_env, on_two_joined_processes
from test_shared_shard_check import all_shards

# Run first, before any thread starts: a process with threads cannot leave its mount namespace.
OWN_MOUNTS = """
import ctypes
import subprocess

CLONE_NEWNS = 0x00020000
if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNS) != 0:
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
"""

CHECK_ON_EACH_DEVICE = (
    OWN_MOUNTS
    + """
import os
import sys
import threading

import input_pipeline.dataset_info
import trainer.data
from input_pipeline.dataset_info import load_dataset_info
from trainer.config import load_config
from trainer.parallel.distributed import cluster_from_env, initialize

said, cache, nfs, local, own, *devices = sys.argv[1:]
said = open(said, "w", buffering=1)  # stdout also carries Gloo's lines
subprocess.run(["mount", "--bind", own, local], check=True)
initialize(cluster_from_env())
real_sha256_of, one_line_at_a_time = input_pipeline.dataset_info.sha256_of, threading.Lock()


def said_and_hashed(path):  # called on the check's threads
    with one_line_at_a_time:
        print(f"hashed {path.name}", file=said)
    return real_sha256_of(path)


input_pipeline.dataset_info.sha256_of = said_and_hashed
for start, device in enumerate(devices):
    subprocess.run(["mount", "-o", "ro", device, nfs], check=True)
    for name, dataset in (("nfs", nfs), ("local", local)):
        print(f"check {start} {name} {os.stat(dataset + '/dataset.json').st_dev}", file=said)
        data = load_config(None, [f"data.path={dataset}", f"data.cache_dir={cache}"]).data
        trainer.data.verify_shards(data, [load_dataset_info(dataset)], ("data.path", name))
        print("passed", file=said)
    subprocess.run(["umount", nfs], check=True)
"""
)

LOAD_ON_EACH_DEVICE = (
    OWN_MOUNTS
    + """
import os
import sys
import threading

import input_pipeline.dataset_info
from trainer.config import load_config
from trainer.data import load_dataset

cache, nfs, *devices = sys.argv[1:]
real_sha256_of, one_line_at_a_time = input_pipeline.dataset_info.sha256_of, threading.Lock()


def said_and_hashed(path):  # called on the check's threads
    with one_line_at_a_time:
        print(f"hashed {path.name}", flush=True)
    return real_sha256_of(path)


input_pipeline.dataset_info.sha256_of = said_and_hashed
for start, device in enumerate(devices):
    subprocess.run(["mount", "-o", "ro", device, nfs], check=True)
    print(f"check {start} nfs {os.stat(nfs + '/dataset.json').st_dev}", flush=True)
    load_dataset(load_config(None, [f"data.path={nfs}", f"data.cache_dir={cache}"]).data)
    print("passed", flush=True)
    subprocess.run(["umount", nfs], check=True)
"""
)


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


@contextmanager
def one_image_on_two_devices(dataset: Path, folder: Path) -> Iterator[list[str]]:
    """An ext4 image holding `dataset`, attached read-only to two loop devices: one filesystem
    that shows the same inodes and times under two device numbers."""
    image = folder / "nfs.img"
    made = _run("mkfs.ext4", "-q", "-d", str(dataset), str(image), "32M")
    if made.returncode:
        pytest.skip(f"cannot make an ext4 image here: {made.stderr.strip()}")
    devices: list[str] = []
    try:
        for _ in range(2):
            attached = _run("losetup", "--find", "--show", "--read-only", str(image))
            if attached.returncode:
                pytest.skip(f"cannot attach a loop device here: {attached.stderr.strip()}")
            devices.append(attached.stdout.strip())
        probe = _run("unshare", "-m", "mount", "-o", "ro", devices[0], str(folder))
        if probe.returncode:
            pytest.skip(f"cannot mount in a mount namespace here: {probe.stderr.strip()}")
        yield devices
    finally:
        for device in devices:
            _run("losetup", "--detach", device)


def checks_of(said: str) -> list[tuple[str, int, set[str], list[str]]]:
    """For each check a process made in turn: which ("0 nfs": the first start's, of the data on
    the image), the device number it saw, the shards it hashed, and what it said."""
    checks: list[tuple[str, int, set[str], list[str]]] = []
    for line in said.splitlines():
        if line.startswith("check "):
            start, name, device = line.removeprefix("check ").split()
            checks.append((f"{start} {name}", int(device), set(), []))
        elif line.startswith("hashed "):
            checks[-1][2].add(line.removeprefix("hashed "))
        elif checks:
            checks[-1][3].append(line)
    return checks


@pytest.fixture
def mounts(corpus, tmp_path) -> Iterator[tuple[list[str], Path, Path]]:
    """Two loop devices over an image of `corpus`, and the empty folders to mount the image at
    (the "NFS" path) and a host's own copy at (the "local" path)."""
    missing = [
        tool for tool in ("mkfs.ext4", "losetup", "mount", "unshare") if not shutil.which(tool)
    ]
    if missing or sys.platform != "linux":
        pytest.skip(f"needs Linux loop devices and mount namespaces (missing: {missing})")
    with one_image_on_two_devices(corpus, tmp_path) as devices:
        nfs, local = tmp_path / "nfs", tmp_path / "local"
        nfs.mkdir()
        local.mkdir()
        yield devices, nfs, local


def test_hosts_sharing_the_cache_folder_find_their_checks_again_after_a_requeue(
    corpus, tmp_path, repo_root, mounts
):
    """First start: the shards on the image are split between the processes, and each hashes
    all of its own copy. A restart with the loop devices swapped (each host numbers the mount
    otherwise) hashes nothing: before, the one record file held only the last writer's stamps,
    and the other process's own copy, and the image's shards under the other device number,
    were all read again."""
    devices, nfs, local = mounts
    own = [Path(shutil.copytree(corpus, tmp_path / f"own{p}")) for p in range(2)]
    script, said = tmp_path / "check.py", [tmp_path / f"said{p}.txt" for p in range(2)]
    script.write_text(CHECK_ON_EACH_DEVICE)
    cache = tmp_path / "home" / "cache"  # one folder for both, as an NFS-shared home folder
    statuses, printed = on_two_joined_processes(
        repo_root,
        [
            [str(script), str(said[p]), str(cache), str(nfs), str(local), str(own[p]), *order]
            for p, order in enumerate([devices, devices[::-1]])
        ],
        devices=1,
    )
    assert statuses == [0, 0], printed
    checks = [checks_of(path.read_text()) for path in said]
    names = {path.name for path in all_shards(corpus)}
    for process in checks:
        assert [(which, passed) for which, _, _, passed in process] == [
            ("0 nfs", ["passed"]),
            ("0 local", ["passed"]),
            ("1 nfs", ["passed"]),
            ("1 local", ["passed"]),
        ]
    (nfs_0, local_0, again_nfs_0, again_local_0) = checks[0]
    (nfs_1, local_1, again_nfs_1, again_local_1) = checks[1]
    assert nfs_0[1] != nfs_1[1] and again_nfs_0[1] == nfs_1[1], "each its own device number"
    assert nfs_0[2] and nfs_1[2] and not nfs_0[2] & nfs_1[2] and nfs_0[2] | nfs_1[2] == names
    assert local_0[2] == local_1[2] == names
    hashed_again = [again_nfs_0[2], again_local_0[2], again_nfs_1[2], again_local_1[2]]
    assert [len(shards) for shards in hashed_again] == [0, 0, 0, 0], hashed_again


def test_a_restart_on_another_device_number_reads_no_shard_it_has_checked(
    corpus, tmp_path, repo_root, mounts
):
    """One process (`load_dataset`'s own check): the same shards on the same path, under
    another device number (another node's NFS mount, or this one's after a reboot), are not
    read again."""
    devices, nfs, _ = mounts
    script = tmp_path / "load.py"
    script.write_text(LOAD_ON_EACH_DEVICE)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cache"), str(nfs), *devices],
        cwd=repo_root,
        env=cpu_env(PYTHONPATH=str(repo_root)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    first, again = checks_of(done.stdout)
    assert first[1] != again[1]
    assert first[2] == {path.name for path in all_shards(corpus)}
    assert (again[2], again[3]) == (set(), ["passed"])
