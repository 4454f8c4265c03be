"""JSON files replaced whole: a reader sees the old file or the new one, never a part, even while
processes on several hosts that share the folder write the same file."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def write_json(path: Path, value: Any, indent: int | None = 2) -> None:
    """Write `value` to a temporary file beside `path`, then rename it over `path`. The temporary
    name is random: one by process id is the same for two hosts' processes of equal pids (as in
    containers), and one writer then renamed the other's half-written file or lost its own."""
    text = json.dumps(value, indent=indent)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        with open(tmp, "x") as out:  # a new file, with the permissions any other file gets
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
