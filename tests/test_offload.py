"""ZeRO-Offload (`optim.offload`, `model.offload_params`, `model.remat=offload_dots`): the same
numbers as without it, the offloaded state really rests in pinned host memory, it comes in only
where the step needs it (so the step compiled for a GPU needs less device memory), and
checkpoints move between offloaded and plain runs."""

import math

import jax
import numpy as np
import pytest

from tests.test_step import losses, program_for, random_batches
from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import CheckpointConfig, load_config
from trainer.parallel.offload import HOST, device_bytes
from trainer.plan import gpu_target, measure
from trainer.plan.gpu import GpuPlanError

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
    # saved / state bytes: 0.997 on jax 0.10.2, 0.974 on jax 0.12 (its memory analysis differs)
    assert saved == pytest.approx(opt_bytes, rel=0.05)


def test_bf16_offload_gives_the_same_losses():
    """bf16 compute: the forward reads a bf16 copy of the offloaded matrices and the gradients
    are taken through its widening, which is what the model's own cast did: same losses."""
    batches = random_batches(3)
    plain = losses(program_for((1, 1, 1)), batches)[0]
    both = ["optim.offload=true", "model.offload_params=true"]
    np.testing.assert_allclose(losses(program_for((1, 1, 1), both), batches)[0], plain, rtol=1e-6)


def test_forward_gets_compute_dtype_copies_of_offloaded_matrices(batches):
    """The forward pass's copy of an offloaded matrix is cast to bf16 as it arrives, and used
    only so (no float32 device copy lives through the backward pass); norm scales, read in
    float32 by the model, arrive as they are. The float32 parameters come in again, behind the
    gradients' barrier, for the update."""
    program = program_for((1, 1, 1), ["model.offload_params=true"])
    state = program.abstract_state()
    with jax.set_mesh(program.mesh):
        batch = jax.device_put(batches[0], program.batch_sharding)
        step = jax.make_jaxpr(program.train_step)(state, batch).eqns[0].params["jaxpr"].jaxpr
    users = _users(step)
    casts = {}
    for var, (path, _) in zip(step.invars, _flat((state, batch)), strict=True):
        if "params" not in str(path):
            continue
        kinds = sorted(eqn.primitive.name for eqn in users[var])
        assert kinds == ["device_put", "optimization_barrier"], (path, kinds)
        (put,) = [eqn for eqn in users[var] if eqn.primitive.name == "device_put"]
        casts[str(path)] = {
            (eqn.primitive.name, str(eqn.params.get("new_dtype"))) for eqn in users[put.outvars[0]]
        }
    cast = ("convert_element_type", "bfloat16")
    matrices = [p for p in casts if "kernel" in p or "embedding" in p]
    assert matrices and all(casts[p] == {cast} for p in matrices), casts
    assert all(cast not in casts[p] for p in casts if "scale" in p), casts


def _users(jaxpr) -> dict:
    """Each variable of `jaxpr` -> the equations that read it."""
    users = {}
    for eqn in jaxpr.eqns:
        for var in _vars(eqn):
            users.setdefault(var, []).append(eqn)
    return users


def _vars(eqn) -> list:
    """The variables an equation reads (its literals left out)."""
    return [v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)]


def test_optimizer_state_comes_in_only_after_the_gradients(offloaded, batches):
    """Every use of the offloaded optimizer state in the step is an optimization barrier that
    also holds the gradients: XLA cannot copy it in while the activations are alive (before,
    it was copied in first and the GPU's peak did not drop: issue 28)."""
    state = offloaded.abstract_state()
    with jax.set_mesh(offloaded.mesh):
        batch = jax.device_put(batches[0], offloaded.batch_sharding)
        step = jax.make_jaxpr(offloaded.train_step)(state, batch).eqns[0].params["jaxpr"].jaxpr
    paths = [path for path, _ in _flat((state, batch))]
    moments = {v for v, path in zip(step.invars, paths, strict=True) if "opt_state" in str(path)}
    users = [eqn for eqn in step.eqns if moments & set(_vars(eqn))]
    assert users and {eqn.primitive.name for eqn in users} == {"optimization_barrier"}
    assert all(len(eqn.invars) > len(moments) for eqn in users)  # the gradients as well


def test_offload_lowers_the_step_compiled_for_a_gpu():
    """The step compiled for an H200 (jax's CUDA plugin; skipped without it): offloading the
    optimizer state lowers the device memory it needs by at least 80% of the state's bytes, and
    offloading the parameters too by at least half of theirs more (issue 28's acceptance, as
    XLA's GPU buffer assignment predicts it; before, neither lowered anything)."""
    try:
        h200 = gpu_target("h200", 1)
    except GpuPlanError as err:
        pytest.skip(f"no GPU compile here: {err}")
    opt_only, both = ["optim.offload=true"], ["optim.offload=true", "model.offload_params=true"]
    plain, opt, both = (
        measure(load_config(None, [*GPU_SHAPE, *extra]), jax.devices()[:1], h200)
        for extra in ([], opt_only, both)
    )
    assert plain.total - opt.total >= 0.8 * plain.opt_state, (plain.total, opt.total)
    assert opt.total - both.total >= 0.5 * plain.params, (opt.total, both.total)


GPU_SHAPE = [
    "model.num_layers=2",
    "model.d_model=256",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.d_ff=1024",
    "model.vocab_size=8192",
    "data.seq_len=512",
    "data.global_batch_size=16",
    "model.remat=none",
]


def _flat(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


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
