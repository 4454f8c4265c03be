"""The shards this process has already checked against their sha256. A shard that is the same
file, unchanged since (inode number, size, modification and change times), is not read again: a
restart, such as a Slurm requeue, of a run over hundreds of GB of shards starts without
re-reading them all. The change time cannot be set back by copying tools, so a shard rewritten
in place is read again.

Processes that start together read each shard once among them where they read the same files
(`shards_to_hash`): a shard every process sees with the same `shared_stamp` is one file on
shared storage (NFS and Lustre give each client the server's inode number and times), so one
process's hash of it holds for all. Separate copies made by copying tools differ in their change
times. A disk image cloned to every host does not: its copies look shared, and each host hashes
only its share of its own copy. Every shard of the image is still checked, on one host's copy;
bytes that differ on another host's copy without a change of its stamp (damaged in the cloning,
or on that disk since) are caught only as they are read (ArrayRecord chunk and TFRecord record
checksums), as on a restart that trusts this record.

Each process keeps its own record, named by its process index (`record_file`): the default cache
folder is in the home folder, which most clusters share among hosts, and one file saved whole by
every host kept only the last writer's entries (host-local copies at one path collide there). The
index, unlike a host name, is the same after a Slurm requeue onto other nodes or in a Kubernetes
pod of another name. The stamps leave out the device number: an NFS mount's is numbered by each
client as it mounts, so another host, or the same one after a reboot, would find none alike. A
record from before these files were per process (`verified-shards.json`) is not read: the first
start after the upgrade checks every shard once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from input_pipeline.atomic import write_json


def record_file(cache_dir: Path, process: int) -> Path:
    """The record of process `process` in the cache folder (`corpora.default_cache_dir`)."""
    return cache_dir / f"verified-shards.{process}.json"


Stamp = tuple[int, int, int, int]  # `shared_stamp`: inode number, size, mtime_ns, ctime_ns


def shared_stamp(path: str | Path) -> Stamp:
    """What changes whenever the file at `path` is replaced or written, and what every host that
    mounts the same file sees alike: not the device number, which each host numbers its mounts
    by."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def shards_to_hash(
    stamps_PxSx4: np.ndarray, unchecked_PxS: np.ndarray, me: int
) -> tuple[np.ndarray, list[int]]:
    """Which shards each process sees as one shared file, and which of the shards process `me`
    hashes, from every process's `shared_stamp` of every shard and whether its record lacks it.
    A shared shard any process lacks is hashed by one process: largest first, each to the
    process with the fewest bytes to hash so far (the lowest on a tie). Any other shard is
    hashed by every process whose record lacks it, each its own copy."""
    shared_S = (stamps_PxSx4 == stamps_PxSx4[0]).all(axis=(0, 2))
    mine = [s for s in range(len(shared_S)) if not shared_S[s] and unchecked_PxS[me, s]]
    sizes = stamps_PxSx4[0, :, 1]
    to_split = [s for s in range(len(shared_S)) if shared_S[s] and unchecked_PxS[:, s].any()]
    loads = [0] * len(stamps_PxSx4)
    for shard in sorted(to_split, key=lambda s: (-sizes[s], s)):
        process = loads.index(min(loads))
        loads[process] += int(sizes[shard])
        if process == me:
            mine.append(shard)
    return shared_S, sorted(mine)


class VerifiedShards:
    """The record in `record` (a JSON file) of shards whose sha256 matched, by their real path.
    A record that cannot be read starts empty, and one that cannot be written is left as it is:
    either way the shards are read again, which is only slower."""

    def __init__(self, record: Path):
        self.record = record
        try:
            entries = json.loads(record.read_text())
        except (OSError, ValueError):
            entries = {}
        self._entries: dict[str, list[str]] = entries if isinstance(entries, dict) else {}

    def known(self, path: str | Path, stamp: Stamp, sha256: str) -> bool:
        """Whether the shard at `path`, now `stamp`, matched `sha256` when it last had it."""
        return self._entries.get(os.path.realpath(path)) == [_stored(stamp), sha256]

    def add(self, path: str | Path, stamp: Stamp, sha256: str) -> None:
        self._entries[os.path.realpath(path)] = [_stored(stamp), sha256]

    def save(self) -> None:
        """Written whole under a temporary name, then renamed: processes that share the cache
        folder never read half a file (the last to save wins; the others' shards are read again
        next time)."""
        try:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.record, self._entries, indent=None)
        except OSError:
            pass


def _stored(stamp: Stamp) -> str:
    """A stamp as the record's JSON keeps it."""
    return ":".join(map(str, stamp))
