"""Keeping a background checkpoint write off the steps where the devices are the host's CPUs.

On GPU/TPU, Orbax copies the state to host memory inside `save` and the device buffers are free
again at once. On CPU that "copy" is a zero-copy view of the device buffers, held until the
background write ends, and the steps that overlap the write pay twice (125m state, 2 cores,
measured in BENCHMARKS.md):

1. The next step cannot reuse (donate) the viewed buffers, so XLA allocates a whole new state:
   1.6 GB of fresh pages, a 6 s step instead of 2.4 s. So on CPU every step writes its new
   state into a spare state (`SaveOverlap.step`), never into the one a save is reading, and
   the spares (two, made at the first step) are never fresh memory mid-write.
2. The writer's threads (TensorStore's `ts_pool_worker`: compression and file writes) compete
   with the step's threads for the same cores. They are moved to Linux's SCHED_IDLE class, so
   they run on the cycles the steps leave free; a write still running at the next save holds
   the loop there, which that save's `ckpt_block_s` shows.

Elsewhere (accelerators) `SaveOverlap` is a plain pass-through to the donating train step.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from trainer.program import TrainProgram
from trainer.state import TrainState

WRITER_THREAD = "ts_pool_worker"  # TensorStore's thread pool, which does Orbax's writing
SPARE_STATES = 2  # on host CPUs: with the current state, three train states of memory


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
    """The loop's train step, aware of the state a background save is still reading.

    On host CPUs every step writes its new state into a spare state instead of updating the
    current one in place; the step's old state becomes a spare in turn, unless a save is still
    reading it. That is also the cheaper step there: XLA:CPU needs 0.16 GB of temporaries for
    the 125m step into a spare against 0.83 GB in place (fresh memory every step). Two spares
    are made at the first step, before any save: three train states of host memory in all, so
    no step ever allocates a state (fresh pages) while a write runs. They are used in turn, so
    none goes cold."""

    def __init__(self, program: TrainProgram, enabled: bool | None = None):
        self._program = program
        self.enabled = devices_are_host_cpus(program) if enabled is None else enabled
        self._being_saved: TrainState | None = None
        self._spares: deque[TrainState] = deque()
        self._blank = jax.jit(
            lambda state: jax.tree.map(jnp.zeros_like, state), out_shardings=program.shardings
        )

    def saving(self, state: TrainState) -> None:
        """`state` was just handed to a background save. Orbax finishes a save's write before
        it starts the next one, so the state of the save before is free again."""
        if not self.enabled:
            return
        if self._being_saved is not None and self._being_saved is not state:
            self._spares.append(self._being_saved)
        self._being_saved = state
        idle_writer_threads()

    def step(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        """One train step: into the oldest spare on host CPUs, in place elsewhere."""
        if not self.enabled:
            return self._program.train_step(state, batch)
        if not self._spares:  # the first step, or state changed hands without this class
            self._spares.extend(self._blank(state) for _ in range(SPARE_STATES))
        new_state, metrics = self._program.train_step_into(self._spares.popleft(), state, batch)
        if state is not self._being_saved:
            self._spares.append(state)
        else:
            idle_writer_threads()  # the pool may have grown since the save started
        return new_state, metrics
