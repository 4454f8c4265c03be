"""Keeping a background checkpoint write off the steps where the devices are the host's CPUs.

On GPU/TPU, Orbax copies the state to host memory inside `save` and the device buffers are free
again at once. On CPU that "copy" is a zero-copy view of the device buffers, held until the
background write ends, and the steps that overlap the write pay twice (125m state, 2 cores,
measured in BENCHMARKS.md):

1. The next step cannot reuse (donate) the viewed buffers, so XLA allocates a whole new state:
   1.6 GB of fresh pages, a 6 s step instead of 2.4 s. `SaveOverlap.step` writes that one step's
   new state into a spare state instead: the state of the save before, whose write is over by
   then (Orbax finishes one save before it starts the next). The spare is made once per run.
2. The writer's threads (TensorStore's `ts_pool_worker`: compression and file writes) compete
   with the step's threads for the same cores. They are moved to Linux's SCHED_IDLE class, so
   they run on the cycles the steps leave free; a write still running at the next save holds
   the loop there, which that save's `ckpt_block_s` shows.

Elsewhere (accelerators) `SaveOverlap` is a plain pass-through to the donating train step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from trainer.program import TrainProgram
from trainer.state import TrainState

WRITER_THREAD = "ts_pool_worker"  # TensorStore's thread pool, which does Orbax's writing


def devices_are_host_cpus(program: TrainProgram) -> bool:
    return all(device.platform == "cpu" for device in program.mesh.devices.flat)


def idle_writer_threads() -> int:
    """Move this process's TensorStore worker threads to SCHED_IDLE; returns how many moved.

    Linux only (elsewhere, or where the kernel refuses, the threads keep their priority: the
    saves are then merely slower to overlap, never wrong)."""
    if not hasattr(os, "sched_setscheduler"):
        return 0
    moved = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != WRITER_THREAD:
                continue
            thread_id = int(task.name)
            if os.sched_getscheduler(thread_id) != os.SCHED_IDLE:
                os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
                moved += 1
        except OSError:  # the thread ended meanwhile, or the system forbids the change
            continue
    return moved


class SaveOverlap:
    """The loop's train step, aware of the state a background save is still reading."""

    def __init__(self, program: TrainProgram, enabled: bool | None = None):
        self._program = program
        self.enabled = devices_are_host_cpus(program) if enabled is None else enabled
        self._being_saved: TrainState | None = None
        self._spare: TrainState | None = None
        self._blank = jax.jit(
            lambda state: jax.tree.map(jnp.zeros_like, state), out_shardings=program.shardings
        )

    def saving(self, state: TrainState) -> None:
        """`state` was just handed to a background save."""
        if self.enabled:
            self._being_saved = state
            idle_writer_threads()

    def step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, Any]:
        """One train step; right after a save, into the spare, leaving `state` to the writer."""
        if self._being_saved is not state:  # no save is reading this state
            return self._program.train_step(state, batch)
        if self._spare is None:
            self._spare = self._blank(state)
        new_state, metrics = self._program.train_step_into(self._spare, state, batch)
        self._spare, self._being_saved = state, None  # reused after this save's write is over
        idle_writer_threads()  # the pool may have grown since the save started
        return new_state, metrics
