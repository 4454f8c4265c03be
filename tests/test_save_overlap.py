"""Steps that overlap a background save on CPU: the step after a save writes into a spare state,
so the saved state stays what the writer reads, and training gives exactly the same numbers."""

import os

import jax
import numpy as np
import pytest
from conftest import TINY

from trainer import sharding
from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import CheckpointConfig, load_config
from trainer.save_overlap import WRITER_THREAD, SaveOverlap, idle_writer_threads
from trainer.train import builder_for_vocab


@pytest.fixture(scope="module")
def program():
    from trainer.program import build_program

    config = load_config(None, [*TINY, "mesh.data=2", "mesh.fsdp=4"])
    return build_program(config, sharding.make_mesh(config.mesh), builder_for_vocab(config, 256))


def batches(program, count):
    rng = np.random.default_rng(0)
    B, L = 16, 64
    for _ in range(count):
        tokens = rng.integers(0, 256, (B, L + 1)).astype(np.int32)
        host = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "weights": np.ones((B, L), np.float32),
        }
        yield jax.device_put(host, program.batch_sharding)


def host_copy(state):
    return [np.array(leaf) for leaf in jax.tree.leaves(state)]


def test_saving_every_step_changes_no_number_and_saves_what_was_stepped(program, tmp_path):
    assert SaveOverlap(program).enabled  # the test devices are CPUs: the spare path runs
    with jax.set_mesh(program.mesh):
        plain, plain_losses = program.init(), []
        for batch in batches(program, 6):
            plain, metrics = program.train_step(plain, batch)
            plain_losses.append(float(metrics["loss"]))

        overlap = SaveOverlap(program)
        checkpointer = Checkpointer(tmp_path, CheckpointConfig(keep=10))
        state, losses, saved = program.init(), [], {}
        meta = {"param_shapes": param_shapes(state.params)}
        for step, batch in enumerate(batches(program, 6), start=1):
            state, metrics = overlap.step(state, batch)
            losses.append(float(metrics["loss"]))
            if step % 2 == 0:  # the next step runs while this save is written
                saved[step] = host_copy(state)
                checkpointer.save(step, state, None, meta)
                overlap.saving(state)
        checkpointer.wait()
        for step, expected in saved.items():
            restored, _ = checkpointer.restore(step, program.abstract_state())
            for want, got in zip(expected, host_copy(restored), strict=True):
                np.testing.assert_array_equal(want, got)
        checkpointer.close()
    assert losses == plain_losses
    for want, got in zip(host_copy(plain), host_copy(state), strict=True):
        np.testing.assert_array_equal(want, got)


def buffer_addresses(state) -> list[int]:
    return [
        shard.data.unsafe_buffer_pointer()
        for leaf in jax.tree.leaves(state)
        for shard in leaf.addressable_shards
    ]


def test_the_step_after_a_save_writes_into_the_spare_not_fresh_memory(program):
    """The spare is an argument the step never reads: `jax.jit` prunes such arguments (and
    their donation) unless told to keep them, and the step then allocated a whole new state."""
    with jax.set_mesh(program.mesh):
        state = program.init()
        spare = jax.tree.map(lambda leaf: leaf + 0, state)
        spare_addresses = buffer_addresses(spare)
        batch = next(batches(program, 1))
        new_state, _ = program.train_step_into(spare, state, batch)
        assert buffer_addresses(new_state) == spare_addresses
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(spare))
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling classes")
def test_writer_threads_run_at_idle_priority_after_a_save(program, tmp_path):
    with jax.set_mesh(program.mesh):
        state = program.init()
        checkpointer = Checkpointer(tmp_path, CheckpointConfig())
        checkpointer.save(1, state, None, {"param_shapes": param_shapes(state.params)})
        SaveOverlap(program).saving(state)
        writers = _writer_threads()
        assert writers, "TensorStore's writer threads were not found by name"
        assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in writers if _alive(t))
        checkpointer.wait()
        checkpointer.close()
    # The pool may grow while the write runs; the loop's next step moves the newcomers.
    idle_writer_threads()
    assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in _writer_threads() if _alive(t))
    assert idle_writer_threads() == 0  # already idle: nothing left to move


def _writer_threads() -> list[int]:
    return [int(task) for task in os.listdir("/proc/self/task") if _name(task) == WRITER_THREAD]


def _name(task: str) -> str:
    try:
        with open(f"/proc/self/task/{task}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def _alive(task: int) -> bool:
    return os.path.exists(f"/proc/self/task/{task}")


def steps_with_saves(program, overlap, folder, count=9, save_at=(3, 6)):
    """Step through `overlap` with async saves at `save_at`, checking after every step that the
    state being saved was not donated; returns the losses and the state buffer sets, in order."""
    checkpointer = Checkpointer(folder, CheckpointConfig(keep=10))
    with jax.set_mesh(program.mesh):
        state, losses = program.init(), []
        meta = {"param_shapes": param_shapes(state.params)}
        seen, saved = [tuple(buffer_addresses(state))], None
        for step, batch in enumerate(batches(program, count), start=1):
            state, metrics = overlap.step(state, batch)
            losses.append(float(metrics["loss"]))
            seen.append(tuple(buffer_addresses(state)))
            if saved is not None:
                assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(saved))
            if step in save_at:
                checkpointer.save(step, state, None, meta)
                overlap.saving(state)
                saved = state
        checkpointer.wait()
        checkpointer.close()
    return losses, seen


def test_cpu_steps_rotate_three_states_and_leave_the_saved_one_alone(program, tmp_path):
    """Every CPU step writes into a spare: after the first step no step allocates a state (the
    new states live in the same three sets of buffers), and the state a save is reading is never
    donated until the next save starts."""
    _, seen = steps_with_saves(program, SaveOverlap(program), tmp_path)
    assert seen[1] != seen[0]  # the first step already went into a spare
    assert len(set(seen)) == 3


def test_with_one_spare_cpu_steps_keep_to_two_states(program, tmp_path):
    """Where three states do not fit, one spare: still no state allocated after the first step,
    the saved state still never donated, and the same losses as plain in-place steps."""
    with jax.set_mesh(program.mesh):
        plain, plain_losses = program.init(), []
        for batch in batches(program, 9):
            plain, metrics = program.train_step(plain, batch)
            plain_losses.append(float(metrics["loss"]))
    losses, seen = steps_with_saves(program, SaveOverlap(program, spare_states=1), tmp_path)
    assert seen[1] != seen[0]  # the spare is made at the first step, not mid-write
    assert len(set(seen)) == 2
    assert losses == plain_losses
