"""Start JAX's own distributed runtime when this process is one of several; do nothing otherwise.

Must run before any JAX backend call. Where the cluster comes from, first match wins:
1. explicit `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES` and
   `JAX_PROCESS_ID` — or, in a Kubernetes Indexed Job, the pod's `JOB_COMPLETION_INDEX` as the id;
2. a Slurm step with several tasks (`srun`): JAX reads `SLURM_*` itself;
3. `JAX_DISTRIBUTED_AUTO=1`: JAX's own detection (Cloud TPU pod metadata, Open MPI, Kubernetes
   with the `kubernetes` package).

Mistakes get one line and exit 2 where JAX would crash: process 0's port already taken (JAX
segfaults), a peer whose process 0 does not answer within `JAX_INIT_TIMEOUT_S`, and a process
still waiting for others at that time (JAX aborts, 5 s later, with a stack trace blaming "another
task"); Ctrl-C while they are awaited is one line too (exit 130). `check_same_config` and
`check_shared_workdir`, for the CLI to call once joined, catch processes given different configs
or a host-local `run.workdir` (either hangs the first checkpoint save, or trains silently
different replicas), and `check_same_data` a host-local copy of the dataset that differs from
process 0's (it trains silently on other data). `stop_every_process_on_error` stops every process
when a step that reads storage (the data, a checkpoint) fails on one: the others would wait for it
in their next collective.

A dead peer never hangs the job: a process whose peers have not all joined within
`JAX_INIT_TIMEOUT_S` (300) seconds ends (exit 2), and the runtime's own machinery aborts every
process once a peer has missed heartbeats for `JAX_HEARTBEAT_TIMEOUT_S` (20) seconds
(JAX's default, 100, is too slow for a scheduler to notice). A collective with a dead peer fails
at once (Gloo: connection reset), and a dead coordinator is noticed at once. So the scheduler
sees the failure and restarts the job, which resumes from the latest checkpoint.
A peer that is alive but stuck (a hung collective, a blocked read) keeps beating; the step
watchdog (`trainer/observe/watchdog.py`, `run.step_timeout_s`) ends every process waiting on it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from input_pipeline.errors import DataError
from trainer.errors import ConfigError, TrainingError, exit_now

INIT_TIMEOUT_S = 300
# Short enough that the survivors of a dead peer exit well within a minute; long enough that a
# busy host (compiling, writing a checkpoint) keeps beating: heartbeats run on their own thread.
HEARTBEAT_TIMEOUT_S = 20
# A process that finished waits this long at exit for the others to finish too.
SHUTDOWN_TIMEOUT_S = 300
# How a process ends that gave up joining the others: as trainer.main ends a one-line user error,
# and a Ctrl-C before anything was saved.
NOT_JOINED_EXIT = 2
INTERRUPTED_EXIT = 130
# What the CLI ends in one line (exit 2): what a user can fix.
USER_ERRORS = (ConfigError, DataError, TrainingError)
# What JAX's Slurm detection reads in each task of an `srun` step.
SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)


@dataclass(frozen=True)
class ClusterSpec:
    """What `jax.distributed.initialize` gets; `None` fields are left to JAX's auto-detection."""

    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    init_timeout_s: int = INIT_TIMEOUT_S
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S
    shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S


def _int_var(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer; set it to a whole number") from None


def _explicit(environ: Mapping[str, str], timeouts: dict[str, int]) -> ClusterSpec | None:
    address = environ["JAX_COORDINATOR_ADDRESS"]
    if ":" not in address:
        raise ConfigError(
            f"JAX_COORDINATOR_ADDRESS={address!r} has no port; use host:port of process 0"
        )
    port = address.rsplit(":", 1)[1]
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(
            f"JAX_COORDINATOR_ADDRESS={address!r} has no valid port; use host:port of process 0 "
            "with a port in 1..65535"
        )
    count = _int_var(environ, "JAX_NUM_PROCESSES")
    if count is None:
        raise ConfigError("JAX_COORDINATOR_ADDRESS is set but JAX_NUM_PROCESSES is not; set both")
    process_id = _int_var(environ, "JAX_PROCESS_ID", _int_var(environ, "JOB_COMPLETION_INDEX"))
    if process_id is None:
        raise ConfigError(
            "JAX_COORDINATOR_ADDRESS is set but JAX_PROCESS_ID is not; give each process "
            "its id 0..JAX_NUM_PROCESSES-1"
        )
    if count < 1 or not 0 <= process_id < count:
        raise ConfigError(
            f"JAX_PROCESS_ID={process_id} is outside 0..{count - 1} for JAX_NUM_PROCESSES={count}"
        )
    if count == 1:
        return None
    return ClusterSpec("explicit", address, count, process_id, **timeouts)


def _slurm_multi_task(environ: Mapping[str, str]) -> bool:
    """Inside an `srun` step of several tasks (not the batch script that calls `srun`)."""
    tasks = _int_var(environ, "SLURM_STEP_NUM_TASKS", 1)
    return "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ and (tasks or 1) > 1


def cluster_from_env(environ: Mapping[str, str] = os.environ) -> ClusterSpec | None:
    """The cluster this process belongs to, or None when it runs alone."""
    timeouts = {
        "init_timeout_s": _int_var(environ, "JAX_INIT_TIMEOUT_S", INIT_TIMEOUT_S),
        "heartbeat_timeout_s": _int_var(environ, "JAX_HEARTBEAT_TIMEOUT_S", HEARTBEAT_TIMEOUT_S),
        "shutdown_timeout_s": _int_var(environ, "JAX_SHUTDOWN_TIMEOUT_S", SHUTDOWN_TIMEOUT_S),
    }
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return _explicit(environ, timeouts)
    if _slurm_multi_task(environ):
        return ClusterSpec("slurm", **timeouts)
    if environ.get("JAX_DISTRIBUTED_AUTO", "").lower() in ("1", "true", "yes"):
        return ClusterSpec("auto", **timeouts)
    return None


def describe(spec: ClusterSpec) -> str:
    if spec.coordinator_address is None:
        return f"the {spec.source}-detected cluster"
    return (
        f"the cluster at {spec.coordinator_address} as process {spec.process_id} of "
        f"{spec.num_processes}"
    )


def _port_in_use(port: int) -> bool:
    """Whether the coordination service could not listen on `port` (it binds every interface)."""
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        host = "::"
    except OSError:  # no IPv6 on this host
        probe, host = socket.socket(socket.AF_INET), "0.0.0.0"
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is fine
        try:
            probe.bind((host, port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def check_coordinator_port(spec: ClusterSpec) -> None:
    """Process 0 hosts the coordination service; a port already taken crashes it inside JAX (a
    segfault), so say so in one line first."""
    if spec.process_id != 0 or spec.coordinator_address is None:
        return
    port = int(spec.coordinator_address.rsplit(":", 1)[1])
    if _port_in_use(port):
        raise TrainingError(
            f"port {port} of JAX_COORDINATOR_ADDRESS={spec.coordinator_address} is already in "
            "use on process 0's host; stop what holds it or choose a free port "
            "(launch/local.sh: JAX_COORDINATOR_PORT)"
        )


def wait_for_coordinator(spec: ClusterSpec) -> int:
    """Seconds left of the init timeout once process 0's coordinator accepts connections. JAX
    itself aborts with a stack trace blaming "another task" when it never does."""
    if not spec.process_id or spec.coordinator_address is None:
        return spec.init_timeout_s
    host, port = spec.coordinator_address.rsplit(":", 1)
    deadline = time.monotonic() + spec.init_timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(left, 2)):
                return max(1, math.ceil(deadline - time.monotonic()))
        except OSError:  # not listening yet, or its name does not resolve yet (a starting pod)
            time.sleep(min(0.5, max(left, 0)))
    raise TrainingError(
        f"process 0's coordinator at {spec.coordinator_address} did not answer within "
        f"{spec.init_timeout_s} s (JAX_INIT_TIMEOUT_S); start process 0 (JAX_PROCESS_ID=0) on "
        "that host, or fix JAX_COORDINATOR_ADDRESS"
    )


def initialize(spec: ClusterSpec, joined: Callable[[], None] | None = None) -> None:
    """`jax.distributed.initialize` with our timeouts, after a line saying what it tries. Where
    this process knows its peers, not all of them joining within the init timeout ends it with
    one line (exit 2), and so does Ctrl-C while it waits for them (exit 130): see `_on_a_thread`.
    `joined` is called the moment it returns, on the thread that joined: JAX's preemption service
    holds SIGTERM from then on."""
    import jax  # after the environment is read: importing jax starts no backend

    check_coordinator_port(spec)

    print(
        f"joining {describe(spec)} (init timeout {spec.init_timeout_s} s, heartbeat timeout "
        f"{spec.heartbeat_timeout_s} s)",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + spec.init_timeout_s
    init_timeout_s = wait_for_coordinator(spec)

    def join() -> None:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
            shutdown_timeout_seconds=spec.shutdown_timeout_s,
        )
        if joined is not None:
            joined()

    # JAX's own detection (a Cloud TPU pod, Kubernetes) may spend part of the init timeout
    # before its connect starts: there JAX's abort is left to end a join that never completes.
    knows_its_peers = spec.source in ("explicit", "slurm")
    try:
        finished = _on_a_thread(join, deadline if knows_its_peers else None)
    except _InterruptedJoiningError:  # at once: a normal exit waits in JAX's shutdown
        exit_now(
            INTERRUPTED_EXIT,
            f"interrupted without saving while joining {describe(spec)}; re-run the same "
            "command to start (or resume from the latest checkpoint)",
        )
    except (RuntimeError, ValueError) as err:  # e.g. a detected cluster missing a value
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        missing = [v for v in SLURM_VARS if v not in os.environ] if spec.source == "slurm" else []
        if missing:
            raise TrainingError(
                f"could not join {describe(spec)}: this task lacks {', '.join(missing)}; pass "
                "every SLURM_* variable into the task (e.g. its container), or set "
                "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID"
            ) from None
        raise TrainingError(
            f"could not join {describe(spec)}: {first_line}; check the launcher's JAX_* or "
            "scheduler variables and that process 0's address and port are reachable"
        ) from None
    if not finished:  # at once, before the connect still under way aborts the process
        exit_now(NOT_JOINED_EXIT, f"error: {not_joined(spec)}")


def not_joined(spec: ClusterSpec) -> str:
    """Why this process still waits for the others at the init timeout, and the fix. JAX's
    coordination service keeps who has come to itself until all have."""
    unnamed = " (JAX does not say which)"
    if spec.source == "slurm":
        missing, fix = "not every task of the srun step joined", "check that every task started"
    elif spec.num_processes == 2 and spec.process_id == 0:
        missing, unnamed, fix = "process 1 did not join", "", "start process 1 (JAX_PROCESS_ID=1)"
    else:
        missing = "not every process joined"
        fix = f"start every process (JAX_PROCESS_ID 0..{(spec.num_processes or 0) - 1})"
    if spec.source == "explicit":
        fix += " with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES"
    return (
        f"could not join {describe(spec)}: {missing} within JAX_INIT_TIMEOUT_S="
        f"{spec.init_timeout_s} s{unnamed}; {fix}, or raise JAX_INIT_TIMEOUT_S"
    )


class _InterruptedJoiningError(Exception):
    """Ctrl-C came while JAX's connect still waited for the other processes."""


def _on_a_thread(join: Callable[[], None], deadline: float | None) -> bool:
    """Run `join` on a helper thread while the main thread waits for it, until `deadline` (a
    `time.monotonic()`; None: as long as it runs), and say whether it returned by then.

    JAX's connect waits in C++ until every process has come, and Python runs signal handlers
    only once the main thread is back in Python: a SIGTERM during that wait (a Slurm time-limit
    warning while a peer still starts) went unheard until every peer had come, or JAX's init
    timeout aborted the process. The waits are short so that a signal delivered to another
    thread is handled too. That abort (a C++ stack trace blaming "another task") comes 5 s after
    the init timeout JAX was given, counted from a moment after `deadline` was set: so the main
    thread, past `deadline` with `join` still running, has those 5 s to say so first."""
    failure: list[BaseException] = []
    returned = threading.Event()  # not Thread.is_alive: a Ctrl-C in Thread.join marks it ended

    def run() -> None:
        try:
            join()
        except BaseException as err:  # raised again on the main thread
            failure.append(err)
        finally:
            returned.set()

    try:
        threading.Thread(target=run, name="joining JAX's runtime", daemon=True).start()
        while not returned.is_set() and (left := _time_left(deadline)) > 0:
            returned.wait(timeout=min(0.5, left))
    except KeyboardInterrupt:
        if not returned.is_set():
            raise _InterruptedJoiningError from None
        raise
    if failure:
        raise failure[0]
    return returned.is_set()


def _time_left(deadline: float | None) -> float:
    return math.inf if deadline is None else deadline - time.monotonic()


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
