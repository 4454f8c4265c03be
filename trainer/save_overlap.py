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
SPARE_STATES = 2  # on host CPUs, memory allowing: with the current state, three train states


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
    none goes cold. Where three states would take more than half the host's memory, one spare
    is made (two states, what a save on CPU needs anyway): the steps between the one after a
    save and the next save then update in place."""

    def __init__(
        self, program: TrainProgram, enabled: bool | None = None, spare_states: int | None = None
    ):
        self._program = program
        self.enabled = devices_are_host_cpus(program) if enabled is None else enabled
        self._spare_states = spare_states  # None: by the host's memory, at the first step
        self._spares_made = False
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
        """One train step: into the oldest spare on host CPUs, in place elsewhere (and on CPU
        when no spare is free and no save reads `state`)."""
        if not self.enabled:
            return self._program.train_step(state, batch)
        if not self._spares_made:  # the first step
            count = spares_that_fit(state) if self._spare_states is None else self._spare_states
            self._spares.extend(self._blank(state) for _ in range(count))
            self._spares_made = True
        saved = state is self._being_saved
        if not self._spares:
            if not saved:
                return self._program.train_step(state, batch)
            self._spares.append(self._blank(state))  # only if saves come faster than steps
        new_state, metrics = self._program.train_step_into(self._spares.popleft(), state, batch)
        if saved:
            idle_writer_threads()  # the pool may have grown since the save started
        else:
            self._spares.append(state)
        return new_state, metrics


def spares_that_fit(state: TrainState) -> int:
    """2 where three train states fit in half the host's memory, else 1."""
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    try:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: be frugal
        return 1
    return SPARE_STATES if (SPARE_STATES + 1) * state_bytes <= host_bytes // 2 else 1
