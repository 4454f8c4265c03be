"""The shards this host has already checked against their sha256. A shard that is the same file,
unchanged since (size, modification and change times), is not read again: a restart, such as a
Slurm requeue, of a run over hundreds of GB of shards starts without re-reading them all. The
change time cannot be set back by copying tools, so a shard rewritten in place is read again."""

from __future__ import annotations

import json
import os
from pathlib import Path

from input_pipeline.atomic import write_json

VERIFIED_FILE = "verified-shards.json"  # in the cache folder (`corpora.default_cache_dir`)


def file_stamp(path: str | Path) -> str:
    """What changes whenever the file at `path` is replaced or written."""
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


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

    def known(self, path: str | Path, stamp: str, sha256: str) -> bool:
        """Whether the shard at `path`, now `stamp`, matched `sha256` when it last had it."""
        return self._entries.get(os.path.realpath(path)) == [stamp, sha256]

    def add(self, path: str | Path, stamp: str, sha256: str) -> None:
        self._entries[os.path.realpath(path)] = [stamp, sha256]

    def save(self) -> None:
        """Written whole under a temporary name, then renamed: processes that share the cache
        folder never read half a file (the last to save wins; the others' shards are read again
        next time)."""
        try:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.record, self._entries, indent=None)
        except OSError:
            pass
