"""Mesh resolution and the logical-axis rules table."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from trainer import sharding
from trainer.config import MeshConfig
from trainer.errors import ConfigError


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
