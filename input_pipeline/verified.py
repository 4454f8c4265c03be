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
only its share of its own copy (none, where the image holds the shards as prepare left them:
`PreparedShards` vouches for them). Bytes that differ on a host's copy without a change of its
stamp (damaged in the cloning, or on that disk since) are caught only as they are read
(ArrayRecord chunk and TFRecord record checksums), as on a restart that trusts this record.

Each process keeps its own record, named by its process index (`record_file`): the default cache
folder is in the home folder, which most clusters share among hosts, and one file saved whole by
every host kept only the last writer's entries (host-local copies at one path collide there). The
index, unlike a host name, is the same after a Slurm requeue onto other nodes or in a Kubernetes
pod of another name. The stamps leave out the device number: an NFS mount's is numbered by each
client as it mounts, so another host, or the same one after a reboot, would find none alike. A
record from before these files were per process (`verified-shards.json`) is not read: the first
start after the upgrade checks every shard once. Two runs started at once on one cache folder
write the same records: each save keeps what the other saved meanwhile (`VerifiedShards.save`).

`prepare` leaves a record of its own in the dataset folder (`PreparedShards`): the stamp each
shard got once it reached its final name, with the sha256 prepare read back from it. A first
start trusts a shard whose stamp is still that one as a restart trusts its own record, so a
dataset just prepared is not read again; a copy (`cp -a` gives each file another inode and
change time), a shard written or touched since, or a dataset prepared before this record existed
is hashed as before."""

from __future__ import annotations

import heapq
import json
import os
from pathlib import Path

import numpy as np

from input_pipeline.atomic import write_json


def record_file(cache_dir: Path, process: int) -> Path:
    """The record of process `process` in the cache folder (`corpora.default_cache_dir`)."""
    return cache_dir / f"verified-shards.{process}.json"


Stamp = tuple[int, int, int, int]  # `shared_stamp`: inode number, size, mtime_ns, ctime_ns
PREPARED_FILE = "prepared-shards.json"  # `PreparedShards`, in the dataset folder


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
    hashes (`hashing_plan`)."""
    shared_S, shares = hashing_plan(stamps_PxSx4, unchecked_PxS)
    return shared_S, shares[me]


def hashing_plan(
    stamps_PxSx4: np.ndarray, unchecked_PxS: np.ndarray
) -> tuple[np.ndarray, list[list[int]]]:
    """Which shards each process sees as one shared file, and the shards each process hashes,
    from every process's `shared_stamp` of every shard and whether its record lacks it. A shared
    shard any process lacks is hashed by one process: largest first, each to the process with
    the fewest bytes to hash so far (the lowest on a tie). Any other shard is hashed by every
    process whose record lacks it, each its own copy."""
    shared_S = (stamps_PxSx4 == stamps_PxSx4[0]).all(axis=(0, 2))
    shares = [np.flatnonzero(~shared_S & unchecked).tolist() for unchecked in unchecked_PxS]
    sizes = stamps_PxSx4[0, :, 1]
    to_split = np.flatnonzero(shared_S & unchecked_PxS.any(axis=0)).tolist()
    loads = [(0, process) for process in range(len(stamps_PxSx4))]  # a heap: fewest bytes first
    for shard in sorted(to_split, key=lambda s: (-sizes[s], s)):
        load, process = heapq.heappop(loads)
        shares[process].append(shard)
        heapq.heappush(loads, (load + int(sizes[shard]), process))
    return shared_S, [sorted(share) for share in shares]


def check_line(stamps_PxSx4: np.ndarray, unchecked_PxS: np.ndarray) -> str | None:
    """What the check about to start reads (`hashing_plan`), said once for all the processes: on
    a first start, hundreds of GB on shared storage are read before the first step, with
    nothing else to show for it. None when nothing is read (every shard known to every
    process)."""
    shared_S, shares = hashing_plan(stamps_PxSx4, unchecked_PxS)
    sizes_PxS = np.maximum(stamps_PxSx4[..., 1], 0)  # -1: a shard gone since it was listed
    read_P = [int(sizes_PxS[p, share].sum()) for p, share in enumerate(shares)]
    shards = sum(len(share) for share in shares)
    if not shards:
        return None
    readers = [p for p, share in enumerate(shares) if share]
    own_copies = any(not shared_S[s] for share in shares for s in share) and len(readers) > 1
    what = f"{shards} shard{'s' if shards > 1 else ''} ({size_text(sum(read_P))}"
    what += ", each process's own copies counted apart)" if own_copies else ")"
    by = f", split over {len(readers)} processes" if len(readers) > 1 else ""
    if len(shares) > 1 and len(readers) == 1:
        by = f", all by process {readers[0]} of {len(shares)}"
    elif own_copies:  # each reads its own copy: nothing is split
        by = f", by {len(readers)} processes, up to {size_text(max(read_P))} on one"
    return (
        f"checking the sha256 of {what} before training{by}; a one-time check: later starts skip "
        "the shards that pass it and are unchanged since (data.verify_checksums=false turns it "
        "off)"
    )


def size_text(size: int) -> str:
    """A byte count as people read it, in decimal units as disks are sold (118.0 GB)."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


class VerifiedShards:
    """The record in `record` (a JSON file) of shards whose sha256 matched, by their real path.
    A record that cannot be read starts empty, and one that cannot be written is left as it is:
    either way the shards are read again, which is only slower."""

    def __init__(self, record: Path):
        self.record = record
        self._entries = _read_entries(record)

    def known(self, path: str | Path, stamp: Stamp, sha256: str) -> bool:
        """Whether the shard at `path`, now `stamp`, matched `sha256` when it last had it."""
        return self._entries.get(os.path.realpath(path)) == [_stored(stamp), sha256]

    def add(self, path: str | Path, stamp: Stamp, sha256: str) -> None:
        self._entries[os.path.realpath(path)] = [_stored(stamp), sha256]

    def save(self) -> None:
        """Written whole under a temporary name, then renamed: processes that share the cache
        folder never read half a file. What another writer saved since this record was read (a
        second run started at once on the same cache folder) is kept (`_merged`)."""
        try:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            self._entries = self._merged()
            write_json(self.record, self._entries, indent=None)
        except OSError:
            pass

    def _merged(self) -> dict[str, list[str]]:
        """These entries, and those in the file now that this record lacks or holds stale, where
        they still match their shard's stamp; none of a shard gone since (its dataset deleted),
        which the record would otherwise keep forever. Another writer saving between this read
        and the rename still wins; its shards are then only read again next time."""
        merged = {path: entry for path, entry in self._entries.items() if os.path.exists(path)}
        for path, entry in _read_entries(self.record).items():
            ours = merged.get(path)
            if entry != ours and _still_current(path, entry) and not _still_current(path, ours):
                merged[path] = entry
        return merged


class PreparedShards:
    """`prepare`'s record in the dataset folder `dataset` (`PREPARED_FILE`): each shard's
    `shared_stamp` once it had its final name, and the sha256 prepare read back from its bytes,
    by its name in the dataset's listing. Kept out of `dataset.json`, which says what the data
    is: its fingerprint stays the same for the same data prepared again, or on another host.
    A record missing or unreadable vouches for nothing: the shards are hashed, which is only
    slower."""

    def __init__(self, dataset: Path):
        self.dataset = dataset
        self._entries = _read_entries(dataset / PREPARED_FILE)

    def vouches(self, path: str | Path, stamp: Stamp, sha256: str) -> bool:
        """Whether prepare read `sha256` from the shard at `path` when it had `stamp`, as it
        still has."""
        name = Path(path).relative_to(self.dataset).as_posix()
        return self._entries.get(name) == [_stored(stamp), sha256]

    @staticmethod
    def write(folder: Path, shards: dict[str, tuple[Stamp, str]]) -> None:
        """Record `shards` (name: stamp, sha256) in the dataset folder `folder`."""
        entries = {name: [_stored(stamp), sha] for name, (stamp, sha) in shards.items()}
        write_json(folder / PREPARED_FILE, entries, indent=None)


def _stored(stamp: Stamp) -> str:
    """A stamp as the record's JSON keeps it."""
    return ":".join(map(str, stamp))


def _read_entries(record: Path) -> dict[str, list[str]]:
    """The entries of the record file `record`; none where it cannot be read."""
    try:
        entries = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _still_current(path: str, entry: object) -> bool:
    """Whether `entry` is a record's `[stamp, sha256]` pair whose stamp the shard at `path` still
    has."""
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
        return False
    try:
        return entry[0] == _stored(shared_stamp(path))
    except OSError:
        return False
