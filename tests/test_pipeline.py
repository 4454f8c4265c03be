"""Pipeline stages: the same losses as one device on every layout they compose with, checkpoints
that do not know the stage count, and one-line errors for layouts that cannot be cut."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import TINY
from test_multihost import reserved_port
from test_step import SMALL, VOCAB, random_batches

from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import CheckpointConfig, load_config
from trainer.data import check_batch_layout
from trainer.errors import ConfigError
from trainer.models import builder_for_vocab
from trainer.parallel import sharding
from trainer.parallel.pipeline import bubble_fraction
from trainer.program import build_program
from trainer.train import run

FOUR_LAYERS = [*SMALL, "model.num_layers=4", "precision.compute=float32"]


def program_for(mesh_shape, overrides=()):
    """A program on the first stage*data*fsdp*tensor devices."""
    config = load_config(None, [*FOUR_LAYERS, *overrides])
    stage, data, fsdp, tensor = mesh_shape
    config = config.derive(
        {"mesh.stage": stage, "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor}
    )
    devices = jax.devices()[: int(np.prod(mesh_shape))]
    return build_program(
        config, sharding.make_mesh(config.mesh, devices), builder_for_vocab(config, VOCAB)
    )


def train(program, batches, state=None):
    state = program.init() if state is None else state
    losses = []
    with jax.set_mesh(program.mesh):
        for batch in batches:
            state, metrics = program.train_step(
                state, jax.device_put(batch, program.batch_sharding)
            )
            losses.append(float(metrics["loss"]))
    return np.array(losses), state


@pytest.fixture(scope="module")
def batches():
    return random_batches(5)


@pytest.fixture(scope="module")
def one_device_run(batches):
    """Losses and the final state of the unpipelined reference on one device."""
    return train(program_for((1, 1, 1, 1)), batches)


@pytest.fixture(scope="module")
def one_device(one_device_run):
    return one_device_run[0]


@pytest.fixture(scope="module")
def two_stages(batches):
    """2 stages x 4 microbatches (the default: 2 x stages): losses and the final state."""
    return train(program_for((2, 4, 1, 1)), batches)


def test_two_stages_match_one_device(two_stages, one_device):
    np.testing.assert_allclose(two_stages[0], one_device, rtol=1e-5)


@pytest.mark.parametrize(
    ("mesh_shape", "overrides"),
    [
        ((4, 2, 1, 1), []),  # 4 stages, one layer each
        ((2, 1, 2, 2), ["pipeline.microbatches=2"]),  # with FSDP and tensor parallelism
        ((2, 4, 1, 1), ["optim.accum_steps=2", "pipeline.microbatches=2"]),
        ((2, 4, 1, 1), ["model.remat=full", "model.scan_layers=false"]),
    ],
)
def test_pipelined_losses_match_one_device(mesh_shape, overrides, batches, one_device):
    got, _ = train(program_for(mesh_shape, overrides), batches)
    np.testing.assert_allclose(got, one_device, rtol=1e-5)


def test_a_stage_holds_only_its_layers():
    """Per device, the stacked layers are split over the stages, never gathered whole."""
    program = program_for((4, 2, 1, 1))
    kernel = program.shardings.params["blocks"]["mlp"]["up"]["kernel"]
    assert kernel.spec[0] == "stage"
    state = program.abstract_state()
    up = state.params["blocks"]["mlp"]["up"]["kernel"]
    assert kernel.shard_shape(up.shape)[0] == 1  # 4 layers over 4 stages


@pytest.mark.parametrize(
    ("saved_on", "restored_on"),
    [("two stages", [(1, 8, 1, 1), (4, 2, 1, 1)]), ("one device", [(2, 4, 1, 1)])],
)
def test_checkpoints_restore_across_stage_counts(
    saved_on, restored_on, two_stages, one_device_run, tmp_path
):
    """Parameters keep their [layers, ...] layout on any stage count: a checkpoint saved with 2
    stages restores onto 1 and onto 4 stages, one saved without stages onto 2, every array
    identical and sharded for its mesh."""
    saved = (two_stages if saved_on == "two stages" else one_device_run)[1]
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    checkpointer.save(5, saved, {"position": 5}, {"param_shapes": param_shapes(saved.params)})
    checkpointer.close()
    for mesh_shape in restored_on:
        program = program_for(mesh_shape)
        checkpointer = Checkpointer(tmp_path, CheckpointConfig())
        restored, _, _ = checkpointer.restore(5, program.abstract_state())
        checkpointer.close()
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        kernel = restored.params["blocks"]["mlp"]["up"]["kernel"]
        assert kernel.sharding == program.shardings.params["blocks"]["mlp"]["up"]["kernel"]


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 16) == pytest.approx(3 / 19)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mesh.stage=3"], "model.num_layers=4 does not split into mesh.stage=3 equal stages"),
        (["mesh.stage=4", "pipeline.microbatches=2"], "pipeline.microbatches=2 is fewer than"),
        (["mesh.stage=2", "pipeline.microbatches=3"], "microbatches=3 is not a multiple of mesh"),
    ],
)
def test_layouts_that_cannot_be_cut_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*FOUR_LAYERS, *overrides])


def test_microbatches_must_split_over_the_batch_devices():
    with pytest.raises(ConfigError, match="pipeline.microbatches=4 = 2 rows do not split"):
        check_batch_layout(16, 2, batch_shards=4, microbatches=4)
    check_batch_layout(32, 2, batch_shards=4, microbatches=4)


def test_a_model_of_your_own_has_no_stages(tmp_path):
    config = load_config(None, [*TINY, "mesh.stage=2", f"run.workdir={tmp_path}"])
    with pytest.raises(ConfigError, match="model passed to trainer.run is not split into stages"):
        run(config, model=lambda rngs: None, data=[])


@pytest.mark.slow
def test_a_pipelined_run_reports_its_bubble_and_learns(corpus, tmp_path, capsys):
    config = load_config(
        None,
        [*TINY, f"data.path={corpus}", f"run.workdir={tmp_path}", "run.steps=12", "mesh.stage=2"],
    )
    result = run(config)
    assert (
        "pipeline 2 stages x 4 microbatches (bubble 20.0% of each step)" in capsys.readouterr().err
    )
    assert result.last_metrics["loss"] < 5.0  # from ln(256) = 5.5 at the start


STAGE_OF_PROCESS = """
import sys, jax
jax.config.update("jax_num_cpu_devices", 2)
port, process = sys.argv[1:]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(process), initialization_timeout=60)
from trainer.parallel import sharding
from trainer.config import MeshConfig
mesh = sharding.make_mesh(MeshConfig(stage=2, data=-1))
print([sorted({d.process_index for d in mesh.devices[s].flat}) for s in range(2)])
"""


def test_stages_are_laid_over_hosts_first(repo_root):
    """`stage` is the mesh's outermost axis: with two hosts, each stage is one host's devices,
    so only activations cross the slow link between them, never weights."""
    with reserved_port() as port:  # held until process 0's coordinator listens there
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", STAGE_OF_PROCESS, str(port), str(i)],
                cwd=repo_root,
                env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"},
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for i in range(2)
        ]
        outputs = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]
    assert outputs == ["[[0], [1]]", "[[0], [1]]"]
