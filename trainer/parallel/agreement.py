"""What the processes of a run must agree on, each in one small all-gather (`gather_rows`).

`check_same_config` and `check_shared_workdir`, for the CLI to call once joined, catch processes
given different configs or a host-local `run.workdir` (either hangs the first checkpoint save, or
trains silently different replicas), and `check_same_data` a host-local copy of the dataset that
differs from process 0's (it trains silently on other data). `stop_every_process_on_error` stops
every process when a step that reads storage (the data, a checkpoint) fails on one: the others
would wait for it in their next collective. Alone, each is a no-op or `mine[None]`: no call.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from trainer.errors import USER_ERRORS, ConfigError, TrainingError


def _settings(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """`section.key` and value for every leaf of a nested config dict, in sorted order."""
    for name in sorted(tree):
        value = tree[name]
        if isinstance(value, Mapping):
            yield from _settings(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:4], "little", signed=True)


def gather_rows(mine: np.ndarray) -> tuple[np.ndarray, int | None]:
    """Every process's `mine` (the same shape and dtype on each), one row per process, and the
    first process whose row differs from process 0's (None: all agree): one small all-gather."""
    from jax.experimental import multihost_utils

    everyone = np.asarray(multihost_utils.process_allgather(mine))  # alone: `mine[None]`, no call
    unlike = (p for p in range(1, len(everyone)) if not np.array_equal(everyone[p], everyone[0]))
    return everyone, next(unlike, None)


def stop_every_process_if(failure: Exception | None, elsewhere: Callable[[int], Exception]) -> None:
    """Raise `failure` here, and on every other process `elsewhere(p)`, p the first process it
    was raised on (one small all-gather): a process that stopped alone left the others waiting
    in their next collective until JAX's coordination service aborted them."""
    stop_every_process_with_kind(failure, 1, lambda process, _: elsewhere(process))


def stop_every_process_with_kind(
    failure: Exception | None, kind: int, elsewhere: Callable[[int, int], Exception]
) -> None:
    """`stop_every_process_if`, whose one all-gather also carries `kind` (a positive number the
    caller gives the kind of `failure`), so that `elsewhere(p, kind of p's failure)` gives the
    others a line that fits what process p met."""
    first = _first_to_stop(kind if failure is not None else 0)
    if failure is not None:
        raise failure
    if first is not None:
        raise elsewhere(*first)


# What a process met in a `stop_every_process_on_error` block, as the others are told: a user's
# error (its own one line says why) or another (a bug: its traceback says where).
USER_ERROR, UNEXPECTED_ERROR = 1, 2


@contextlib.contextmanager
def stop_every_process_on_error(
    doing: str, elsewhere: Callable[[int], Exception]
) -> Iterator[None]:
    """Run the block on every process; when it raises on any, every process stops at its end:
    that one with its own exception, unchanged, and the others with `elsewhere(p)` for a user's
    error on process p, or a line naming p's unexpected error while `doing`. A process that
    stopped alone left the others waiting in their next collective until JAX's coordination
    service aborted them."""
    try:
        yield
    except Exception as err:
        _first_to_stop(USER_ERROR if isinstance(err, USER_ERRORS) else UNEXPECTED_ERROR)
        raise
    first = _first_to_stop(0)
    if first is None:
        return
    process, kind = first
    if kind == USER_ERROR:
        raise elsewhere(process)
    raise TrainingError(
        f"process {process} met an unexpected error while {doing} (its own log has the "
        "traceback, a bug to report); every process stopped with it"
    )


def _first_to_stop(kind: int) -> tuple[int, int] | None:
    """The first process that gave a `kind` other than 0 (this one's, 0: it goes on), and its
    kind; None when none did: one small all-gather."""
    everyone, _ = gather_rows(np.array(kind, np.int32))
    failed = np.flatnonzero(everyone)
    return (int(failed[0]), int(everyone[failed[0]])) if failed.size else None


def check_same_config(config: Mapping[str, Any]) -> None:
    """Every process must train the same config: one given another `run.workdir` hangs in its
    first checkpoint save, and another learning rate silently trains different replicas. Call it
    after joining the cluster, with the resolved config as a nested dict; a no-op alone."""
    import jax

    if jax.process_count() == 1:
        return
    names, values = zip(*_settings(config), strict=True)
    everyone, other = gather_rows(np.array([_digest(v) for v in values], np.int32))
    if other is None:
        return
    keys = [n for n, a, b in zip(names, everyone[0], everyone[other], strict=True) if a != b]
    me = jax.process_index()
    here = ", ".join(f"{n}={v!r}" for n, v in zip(names, values, strict=True) if n in keys[:3])
    raise ConfigError(
        f"process {other}'s config differs from process 0's in {', '.join(keys)} (process {me} "
        f"has {here}); give every process the same --config file and overrides"
    )


# Room for a dataset fingerprint (`DatasetInfo.fingerprint`: 16 hex characters) in the all-gather.
FINGERPRINT_BYTES = 64
NO_FINGERPRINT = "none (batches passed to trainer.run)"


def check_same_data(fingerprint: str | None, setting: str, value: str) -> None:
    """Every process must read the same prepared dataset: a host-local copy that is stale or
    prepared with other settings trains silently on other data. `fingerprint` is the run's data
    identity, None for a caller's own batches (each host's own rows: nothing to compare but
    their kind); `setting`=`value` says where the data comes from, e.g. `data.path`,
    `data/web`. Call it on every process once the data is open; a no-op alone."""
    import jax

    if jax.process_count() == 1:
        return
    mine = (fingerprint or "").encode()[:FINGERPRINT_BYTES].ljust(FINGERPRINT_BYTES, b"\0")
    everyone, other = gather_rows(np.frombuffer(mine, np.uint8))
    if other is None:
        return
    fingerprints = [_fingerprint_in(row) for row in everyone]
    raise ConfigError(
        f"process {other} reads other data than process 0 at {setting}={value} (dataset "
        f"fingerprint {fingerprints[other]}; process 0's {fingerprints[0]}); give every host the "
        f"same prepared dataset: copy it to each host again, {_shared_storage(setting)}"
    )


def data_not_opened(process: int, setting: str, value: str) -> str:
    """What the other processes say when `process` could not open or check its data."""
    return (
        f"process {process} could not open its data at {setting}={value} (its own log says "
        f"why); repair that host's copy, {_shared_storage(setting)}"
    )


def _shared_storage(setting: str) -> str:
    return f"or point {setting} at storage every host mounts (NFS, Lustre, ...)"


def _fingerprint_in(row: np.ndarray) -> str:
    return row.tobytes().rstrip(b"\0").decode() or NO_FINGERPRINT


def _sees(path: Path, wait_s: float) -> bool:
    """Whether `path` exists here within `wait_s` seconds (a network filesystem may lag)."""
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def check_shared_workdir(workdir: str | os.PathLike, wait_s: float = 10.0) -> None:
    """Every process must see the same `run.workdir`: on a host-local disk each one writes its
    own part of a checkpoint and the first save hangs. Process 0 leaves a file there and every
    process looks for it; a no-op alone."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return
    token, why = secrets.randbits(31), " (process 0's log says why)"
    if jax.process_index() == 0:
        try:
            Path(workdir).mkdir(parents=True, exist_ok=True)
            (Path(workdir) / f".written-by-process-0.{token}").write_text("")
        except OSError as err:
            token, why = -1, f": {err.strerror}"
    token = int(multihost_utils.broadcast_one_to_all(np.int32(token)))  # process 0's
    if token < 0:  # every process stops, not only process 0
        raise TrainingError(
            f"process 0 cannot write run.workdir={workdir}{why}; choose a writable folder"
        )
    marker = Path(workdir) / f".written-by-process-0.{token}"
    seen, _ = gather_rows(np.array(_sees(marker, wait_s), np.int32))
    if jax.process_index() == 0:
        marker.unlink(missing_ok=True)
    blind = [p for p, saw in enumerate(seen) if not saw]
    if blind:
        raise ConfigError(
            f"run.workdir={workdir} is not one shared folder: process(es) "
            f"{', '.join(map(str, blind))} do not see the file process 0 wrote there; put "
            "run.workdir on storage every host mounts at the same path (NFS, Lustre, ...)"
        )
