"""Every shipped config parses and builds on the 8 fake devices; the FSDP memory claim holds."""

import functools

import jax
import numpy as np
import pytest

from trainer.config import load_config
from trainer.models import build_model
from trainer.parallel import sharding
from trainer.program import build_program

CONFIGS = sorted(
    p.name for p in (__import__("pathlib").Path(__file__).parents[1] / "configs").glob("*.yaml")
)


def program_from(config):
    build = functools.partial(
        build_model,
        config.model,
        vocab_size=config.model.vocab_size or 256,
        compute_dtype=config.precision.compute,
        param_dtype=config.precision.params,
    )
    return build_program(config, sharding.make_mesh(config.mesh), build)


def per_device_bytes(abstract_state) -> int:
    """Bytes one device holds: each leaf's shard shape under its sharding."""
    total = 0
    for leaf in jax.tree.leaves(abstract_state):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard)) * leaf.dtype.itemsize
    return total


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config_parses_and_builds(name, repo_root):
    config = load_config(repo_root / "configs" / name)
    program = program_from(config)  # abstract: shapes and shardings, no weights allocated
    abstract = program.abstract_state()
    assert program.num_params > 0
    assert all(leaf.sharding.mesh.devices.size == 8 for leaf in jax.tree.leaves(abstract))


def test_fsdp_shards_params_and_optimizer_state(repo_root):
    """125m: per-device parameters + optimizer state under fsdp=8 are <= 0.15x those of data=8."""
    replicated = load_config(repo_root / "configs/125m.yaml", ["mesh.data=8", "mesh.fsdp=1"])
    fsdp = load_config(repo_root / "configs/125m.yaml", ["mesh.data=1", "mesh.fsdp=8"])
    data_bytes = per_device_bytes(program_from(replicated).abstract_state())
    fsdp_bytes = per_device_bytes(program_from(fsdp).abstract_state())
    assert fsdp_bytes <= 0.15 * data_bytes, (fsdp_bytes, data_bytes)
