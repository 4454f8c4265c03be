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
task"); Ctrl-C while they are awaited is one line too (exit 130). Once joined, what the
processes must agree on is `trainer.parallel.agreement`'s.

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

import errno
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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
