"""The jitted step: the same numbers on every mesh, accumulation equals one big batch, and it
compiles once."""

import contextlib
import functools

import jax
import numpy as np
import pytest

from input_pipeline.device import DeviceFeed
from trainer.config import load_config
from trainer.models import build_model
from trainer.parallel import sharding
from trainer.program import build_program

SMALL = [
    "model.num_layers=2",
    "model.d_model=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.d_ff=128",
    "data.global_batch_size=16",
    "data.seq_len=32",
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    "run.steps=20",
]
VOCAB = 64


def random_batches(n, batch=16, length=32, seed=0):
    """Packed rows with two documents each and some zero-weight padding at the end."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, VOCAB, (batch, length + 1)).astype(np.int32)
        segment_ids = np.ones((batch, length), np.int32)
        segment_ids[:, length // 3 :] = 2
        segment_ids[:, -3:] = 0
        positions = np.zeros_like(segment_ids)
        for b in range(batch):
            for i in range(1, length):
                same = segment_ids[b, i] == segment_ids[b, i - 1]
                positions[b, i] = positions[b, i - 1] + 1 if same else 0
        out.append(
            {
                "inputs": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "segment_ids": segment_ids,
                "positions": positions,
                "weights": (segment_ids > 0).astype(np.float32),
            }
        )
    return out


def program_for(mesh_shape, overrides=()):
    config = load_config(None, [*SMALL, *overrides])
    data, fsdp, tensor = mesh_shape
    config = config.derive({"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor})
    devices = jax.devices()[: data * fsdp * tensor]
    mesh = sharding.make_mesh(config.mesh, devices)
    build = functools.partial(
        build_model,
        config.model,
        vocab_size=VOCAB,
        compute_dtype=config.precision.compute,
        param_dtype=config.precision.params,
    )
    return build_program(config, mesh, build)


def losses(program, batches, compile_events=None):
    """The loss of each step; with `compile_events`, also checks that no step after the first
    compiled anything."""
    state = program.init()
    out, compiled_by_step_1 = [], None
    with jax.set_mesh(program.mesh):
        for batch in batches:
            batch = jax.device_put(batch, program.batch_sharding)
            state, metrics = program.train_step(state, batch)
            out.append(float(metrics["loss"]))
            if compile_events is not None and compiled_by_step_1 is None:
                compiled_by_step_1 = len(compile_events)
    if compile_events is not None:
        assert compiled_by_step_1 >= 1
        assert len(compile_events) == compiled_by_step_1, "the train step recompiled after step 1"
    return np.array(out), state


MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)]


@pytest.fixture(scope="module")
def batches():
    return random_batches(5)


@pytest.fixture(scope="module")
def reference_f32(batches):
    return losses(program_for((1, 1, 1), ["precision.compute=float32"]), batches)[0]


@pytest.fixture(scope="module")
def program_f32_2x2x2():
    """The float32 program on the (2, 2, 2) mesh, built once per module: the tests that step it
    some other way share its compiled plain step and its reference losses."""
    return program_for((2, 2, 2), ["precision.compute=float32"])


@pytest.fixture(scope="module")
def float32_on_2x2x2(batches, program_f32_2x2x2):
    """Losses and final state of the plain float32 step on the (2, 2, 2) mesh, the reference of
    the tests that step that program some other way; trained once per module."""
    return losses(program_f32_2x2x2, batches)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_float32_losses_match_single_device_and_compile_once(
    mesh_shape, batches, reference_f32, compile_events
):
    got, _ = losses(program_for(mesh_shape, ["precision.compute=float32"]), batches, compile_events)
    np.testing.assert_allclose(got, reference_f32, rtol=1e-5)
    assert got[-1] < got[0]  # it learns


def test_bfloat16_losses_match_single_device(batches):
    """bf16 matmuls reorder reductions across shards: agree to 2e-3 relative over 5 steps."""
    ref, _ = losses(program_for((1, 1, 1)), batches)
    got, _ = losses(program_for((2, 2, 2)), batches)
    np.testing.assert_allclose(got, ref, rtol=2e-3)


def test_accumulation_matches_full_batch(batches, float32_on_2x2x2):
    full, full_state = float32_on_2x2x2
    accum, accum_state = losses(
        program_for((2, 2, 2), ["precision.compute=float32", "optim.accum_steps=4"]), batches
    )
    np.testing.assert_allclose(accum, full, rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(accum_state.params), jax.tree.leaves(full_state.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.fixture
def compile_events():
    """Names of XLA backend compilations that happen while the test runs."""
    events = []

    def listen(name, _duration, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield events
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 2, 2)])  # every mesh: the float32 test
def test_compiles_once_with_dropout(mesh_shape, batches, compile_events):
    program = program_for(mesh_shape, ["model.dropout=0.1"])
    state = program.init()
    with jax.set_mesh(program.mesh):
        device_batches = [jax.device_put(b, program.batch_sharding) for b in batches]
        state, _ = program.train_step(state, device_batches[0])
        jax.block_until_ready(state)
        compiled_by_step_1 = len(compile_events)
        for batch in device_batches[1:]:
            state, metrics = program.train_step(state, batch)
        jax.block_until_ready(metrics)
    assert compiled_by_step_1 >= 1
    assert len(compile_events) == compiled_by_step_1, "the train step recompiled after step 1"


def test_state_is_sharded_as_the_rules_say():
    program = program_for((1, 4, 2))
    state = program.init()
    kernel = state.params["blocks"]["mlp"]["up"]["kernel"]  # [layers, embed, mlp]
    # layers over the (here single) pipeline stage, the model width over fsdp, MLP over tensor
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("stage", "fsdp", "tensor")
    mu = state.opt_state[1][0].mu["blocks"]["mlp"]["up"]["kernel"]
    assert mu.sharding.spec == kernel.sharding.spec  # optimizer moments follow the parameter
    assert kernel.addressable_shards[0].data.shape == (2, 64 // 4, 128 // 2)


def test_the_loops_cpu_step_equals_the_donating_step(
    batches, program_f32_2x2x2, float32_on_2x2x2, compile_events
):
    """On CPU the loop steps into a spare state (`TrainProgram.stepper`): the same numbers as
    the in-place step, no compile after the first step, and a state stepped out of turn (another
    run's) is never used as a spare, so it survives to be stepped again."""
    program = program_f32_2x2x2
    step = program.stepper()
    assert step is not program.train_step  # the test devices are CPUs
    reference, _ = float32_on_2x2x2  # this program's own donating step
    state, other = program.init(), program.init()
    got = []
    with jax.set_mesh(program.mesh):
        device_batches = [jax.device_put(b, program.batch_sharding) for b in batches]
        for i, batch in enumerate(device_batches):
            state, metrics = step(state, batch)
            got.append(metrics.read()["loss"])
            if i == 1:
                compiled = len(compile_events)
                other, _ = step(other, batch)  # out of turn: gets a fresh spare
        assert len(compile_events) == compiled, "the spare-state step recompiled"
        _, metrics = step(other, device_batches[2])  # `other` was never overwritten
    np.testing.assert_array_equal(got, reference)
    other_reference, _ = losses(program, batches[1:3])
    assert metrics.read()["loss"] == other_reference[1]


def test_the_loops_in_place_step_takes_the_feeds_batches_as_compiled(
    batches, program_f32_2x2x2, float32_on_2x2x2, compile_events
):
    """The loop's step on GPU/TPU (in place, forced here on CPU): the device feed's batches
    arrive in exactly the shardings it was compiled for, so no step reshards or copies them
    (host-to-device and device-to-device transfers are refused while it steps), the state is
    donated rather than copied, nothing compiles after the first step, and its one packed
    metrics vector reads the same numbers as the plain step's metrics."""
    program = program_f32_2x2x2
    step = program.stepper(in_place=True)
    reference, _ = float32_on_2x2x2
    state = program.init()
    got = []
    with jax.set_mesh(program.mesh):
        with DeviceFeed(iter(batches), program.batch_sharding) as feed:
            placed = [batch for batch, _ in feed]
        compiled = step.lower(state, placed[0]).compile()
        state_shardings, batch_shardings = compiled.input_shardings[0]
        assert batch_shardings == {name: x.sharding for name, x in placed[0].items()}
        assert jax.tree.leaves(state_shardings) == [x.sharding for x in jax.tree.leaves(state)]
        for i, batch in enumerate(placed):
            before = state
            with no_transfers():
                state, metrics = step(state, batch)
            assert all(x.is_deleted() for x in jax.tree.leaves(before))  # donated in place
            if i == 0:
                compiled_by_step_1 = len(compile_events)
            got.append(metrics.read()["loss"])
    assert len(compile_events) == compiled_by_step_1, "the loop's step recompiled"
    np.testing.assert_allclose(got, reference, rtol=1e-6)
    assert set(metrics.read()) == {"loss", "grad_norm", "lr", "tokens", "params_finite"}


@contextlib.contextmanager
def no_transfers():
    """Refuse host-to-device and device-to-device copies (a step's implicit reshards)."""
    with (
        jax.transfer_guard_host_to_device("disallow"),
        jax.transfer_guard_device_to_device("disallow"),
    ):
        yield
