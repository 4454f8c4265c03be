"""Mesh resolution and the logical-axis rules table."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from trainer.config import MeshConfig
from trainer.errors import ConfigError
from trainer.parallel import sharding


def test_fill_axis_takes_the_remaining_devices():
    assert sharding.mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=2), 8) == (1, 2, 2, 2)
    assert sharding.mesh_shape(MeshConfig(data=1, fsdp=-1, tensor=1), 8) == (1, 1, 8, 1)


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        (MeshConfig(data=-1, fsdp=3), "do not divide 8 devices"),
        (MeshConfig(data=2, fsdp=2, tensor=1), "needs 4 devices but 8 are present"),
    ],
)
def test_mesh_errors_name_the_fix(mesh, message):
    with pytest.raises(ConfigError, match=message):
        sharding.mesh_shape(mesh, 8)


def test_make_mesh_uses_all_devices():
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert mesh.devices.size == len(jax.devices()) == 8
    assert mesh.axis_names == ("stage", "data", "fsdp", "tensor")


def test_logical_rules_map_and_never_reuse_an_axis():
    rules = sharding.resolve_rules({"kv": "tensor"})
    assert sharding.logical_to_mesh(P("embed", "mlp"), rules) == P("fsdp", "tensor")
    assert sharding.logical_to_mesh(P("layers", "embed", "kv"), rules) == P(
        "stage", "fsdp", "tensor"
    )
    # heads and kv both map to tensor: the second use is dropped, never duplicated
    assert sharding.logical_to_mesh(P("heads", "kv"), rules) == P("tensor", None)


def test_rules_errors():
    with pytest.raises(ConfigError, match="not a mesh axis"):
        sharding.resolve_rules({"embed": "model"})
    with pytest.raises(ConfigError, match="no sharding rule"):
        sharding.logical_to_mesh(P("experts"), sharding.resolve_rules())


def test_fsdp_keeps_each_devices_activations_to_its_own_rows():
    """FSDP over 8 devices needs no more step memory than data parallelism over 8: each device
    computes its own rows with gathered weights. Without `rows_like_the_batch` GSPMD followed the
    width-sharded weights instead, gathered the batch, and held 5x the temporaries."""
    from trainer.config import load_config
    from trainer.plan import measure

    model = ["model.num_layers=2", "model.d_model=128", "model.d_ff=512", "model.vocab_size=512"]
    run = ["data.seq_len=128", "data.global_batch_size=64", "model.remat=save_dots"]
    temporaries = {
        mesh: measure(load_config(None, [*model, *run, *mesh]), jax.devices()).temporaries
        for mesh in (("mesh.data=8",), ("mesh.data=1", "mesh.fsdp=8"))
    }
    data_parallel, fsdp = temporaries.values()
    assert fsdp < 1.2 * data_parallel, temporaries


@pytest.mark.parametrize(
    "rules, message",
    [
        ({"kv": "tensor", "norm": None}, None),  # the model's own axes and the defaults: fine
        ({"kv_heads": "tensor"}, "mesh.rules.kv_heads names no axis of this model's parameters"),
    ],
)
def test_a_rule_for_an_axis_the_model_lacks_is_refused(rules, message):
    """A typo in mesh.rules (`kv_heads` for `kv`) used to train with that layout unsharded."""
    from trainer.config import load_config
    from trainer.models import builder_for_vocab
    from trainer.program import build_program

    config = load_config("configs/tiny.yaml", ["mesh.data=1"]).derive({"mesh.rules": rules})
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    build = lambda: build_program(config, mesh, builder_for_vocab(config, 256))  # noqa: E731
    if message is None:
        assert "kv" in build().skeleton.logical_axes
        return
    with pytest.raises(ConfigError, match=message):
        build()
