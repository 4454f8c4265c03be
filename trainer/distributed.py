"""Start JAX's distributed runtime when this process is one of several; do nothing otherwise.

Must run before any JAX backend call. Sources, in order: explicit `JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; else a multi-task Slurm step, which JAX detects itself.
"""

from __future__ import annotations

import os

import jax

INIT_TIMEOUT_S = 300


def _slurm_multi_task() -> bool:
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in os.environ


def maybe_initialize() -> bool:
    """Initialize `jax.distributed` if the environment describes several processes."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
            initialization_timeout=INIT_TIMEOUT_S,
        )
        return True
    if _slurm_multi_task():
        jax.distributed.initialize(initialization_timeout=INIT_TIMEOUT_S)
        return True
    return False
