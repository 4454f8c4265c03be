"""Start JAX's own distributed runtime when this process is one of several; do nothing otherwise.

Must run before any JAX backend call. Where the cluster comes from, first match wins:
1. explicit `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES` and
   `JAX_PROCESS_ID` — or, in a Kubernetes Indexed Job, the pod's `JOB_COMPLETION_INDEX` as the id;
2. a Slurm step with several tasks (`srun`): JAX reads `SLURM_*` itself;
3. `JAX_DISTRIBUTED_AUTO=1`: JAX's own detection (Cloud TPU pod metadata, Open MPI, Kubernetes
   with the `kubernetes` package).

A dead peer never hangs the job, by the runtime's own machinery: the coordination service
aborts a process (non-zero exit) that cannot register within `JAX_INIT_TIMEOUT_S` (300) seconds,
and every process once a peer has missed heartbeats for `JAX_HEARTBEAT_TIMEOUT_S` (20) seconds
(JAX's default, 100, is too slow for a scheduler to notice). A collective with a dead peer fails
at once (Gloo: connection reset), and a dead coordinator is noticed at once. So the scheduler
sees the failure and restarts the job, which resumes from the latest checkpoint.
A peer that is alive but stuck (a hung collective, a blocked read) keeps beating; the step
watchdog (`trainer/observe/watchdog.py`, `run.step_timeout_s`) ends every process waiting on it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.errors import ConfigError, TrainingError

INIT_TIMEOUT_S = 300
# Short enough that the survivors of a dead peer exit well within a minute; long enough that a
# busy host (compiling, writing a checkpoint) keeps beating: heartbeats run on their own thread.
HEARTBEAT_TIMEOUT_S = 20
# A process that finished waits this long at exit for the others to finish too.
SHUTDOWN_TIMEOUT_S = 300


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


def initialize(spec: ClusterSpec) -> None:
    """`jax.distributed.initialize` with our timeouts, after a line saying what it tries (the
    runtime aborts the process when that fails: see the module docstring)."""
    import jax  # after the environment is read: importing jax starts no backend

    print(
        f"joining {describe(spec)} (init timeout {spec.init_timeout_s} s, heartbeat timeout "
        f"{spec.heartbeat_timeout_s} s)",
        file=sys.stderr,
        flush=True,
    )
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            initialization_timeout=spec.init_timeout_s,
            heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
            shutdown_timeout_seconds=spec.shutdown_timeout_s,
        )
    except (RuntimeError, ValueError) as err:  # e.g. a detected cluster missing a value
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TrainingError(
            f"could not join {describe(spec)}: {first_line}; check the launcher's JAX_* or "
            "scheduler variables and that process 0's address and port are reachable"
        ) from None


def maybe_initialize(environ: Mapping[str, str] = os.environ) -> None:
    """Join the distributed runtime if the environment describes several processes."""
    spec = cluster_from_env(environ)
    if spec is not None:
        initialize(spec)
