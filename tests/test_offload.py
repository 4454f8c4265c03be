"""ZeRO-Offload (`optim.offload`, `model.offload_params`, `model.remat=offload_dots`): the same
numbers as without it, the offloaded state really rests in pinned host memory, and checkpoints
move between offloaded and plain runs."""

import math

import jax
import numpy as np
import pytest

from tests.test_step import losses, program_for, random_batches
from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import CheckpointConfig
from trainer.parallel.offload import HOST, device_bytes

F32 = ["precision.compute=float32"]
FSDP8 = (1, 8, 1)


@pytest.fixture(scope="module")
def batches():
    return random_batches(5)


@pytest.fixture(scope="module")
def reference(batches):
    """Losses on one device, nothing offloaded."""
    return losses(program_for((1, 1, 1), F32), batches)[0]


@pytest.fixture(scope="module")
def offloaded():
    return program_for(FSDP8, [*F32, "optim.offload=true"])


@pytest.fixture(scope="module")
def plain():
    return program_for(FSDP8, F32)


def memory_kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def per_device_bytes(abstract) -> int:
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(abstract)
    )


def test_optimizer_offload_matches_single_device(offloaded, batches, reference):
    got, state = losses(offloaded, batches)
    np.testing.assert_allclose(got, reference, rtol=1e-5)
    assert memory_kinds(state.opt_state) == {HOST}
    assert memory_kinds(state.params) == memory_kinds(state.step) == {"device"}


def test_param_offload_and_offload_dots_match_single_device(batches, reference):
    """Both in one program (each compile costs seconds): values as without remat or offload."""
    overrides = [*F32, "model.offload_params=true", "model.remat=offload_dots"]
    program = program_for((2, 2, 2), overrides)
    got, state = losses(program, batches)
    np.testing.assert_allclose(got, reference, rtol=1e-5)
    assert memory_kinds(state.params) == {HOST}
    assert memory_kinds(state.opt_state) == {"device"}
    with jax.set_mesh(program.mesh):
        batch = jax.device_put(batches[0], program.batch_sharding)
        jaxpr = str(jax.make_jaxpr(program.train_step)(state, batch))
    # the policy sends the saved matmul outputs to the host (XLA:CPU then ignores such copies)
    assert jaxpr.count("devices=(MemorySpace.Host,)") > 0


def test_compiled_step_keeps_optimizer_state_on_host(offloaded, plain, batches):
    compiled = {}
    for name, program in [("offloaded", offloaded), ("plain", plain)]:
        with jax.set_mesh(program.mesh):
            batch = jax.device_put(batches[0], program.batch_sharding)
            compiled[name] = program.train_step.lower(program.abstract_state(), batch).compile()
    (state_in, _), _ = compiled["offloaded"].input_shardings
    state_out, _ = compiled["offloaded"].output_shardings
    for shardings in (state_in, state_out):
        assert {s.memory_kind for s in jax.tree.leaves(shardings.opt_state)} == {HOST}
        assert {s.memory_kind for s in jax.tree.leaves(shardings.params)} == {"device"}
    opt_bytes = per_device_bytes(offloaded.abstract_state().opt_state)
    saved = device_bytes(compiled["plain"]) - device_bytes(compiled["offloaded"])
    assert opt_bytes > 40_000
    assert saved == pytest.approx(opt_bytes, rel=0.02)


def save(directory, step, state):
    checkpointer = Checkpointer(directory, CheckpointConfig())
    checkpointer.save(step, state, {"position": step}, {"param_shapes": param_shapes(state.params)})
    checkpointer.close()


def restore(directory, step, program):
    checkpointer = Checkpointer(directory, CheckpointConfig())
    try:
        return checkpointer.restore(step, program.abstract_state())[0]
    finally:
        checkpointer.close()


def next_loss(program, state, batch) -> float:
    with jax.set_mesh(program.mesh):
        return float(
            program.train_step(state, jax.device_put(batch, program.batch_sharding))[1]["loss"]
        )


def host_values(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_offloaded_checkpoint_restores_and_resumes_either_way(offloaded, plain, batches, tmp_path):
    _, state = losses(offloaded, batches[:4])
    saved_values = host_values(state)
    save(tmp_path / "offloaded", 4, state)
    expected = next_loss(offloaded, state, batches[4])

    back = restore(tmp_path / "offloaded", 4, offloaded)
    assert memory_kinds(back.opt_state) == {HOST}
    for a, b in zip(saved_values, host_values(back), strict=True):
        np.testing.assert_array_equal(a, b)
    assert next_loss(offloaded, back, batches[4]) == expected

    as_plain = restore(tmp_path / "offloaded", 4, plain)
    assert memory_kinds(as_plain.opt_state) == {"device"}
    save(tmp_path / "plain", 4, as_plain)
    np.testing.assert_allclose(next_loss(plain, as_plain, batches[4]), expected, rtol=1e-6)

    as_offloaded = restore(tmp_path / "plain", 4, offloaded)
    assert memory_kinds(as_offloaded.opt_state) == {HOST}
    assert next_loss(offloaded, as_offloaded, batches[4]) == expected
