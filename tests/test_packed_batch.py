"""One array per batch: packing is lossless, zero-copy for the packer's batches, placed with the
rows sharded like a field's, and the jitted step computes exactly what it computes on the dict."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from test_step import VOCAB, program_for, random_batches

from input_pipeline.device import DeviceFeed, to_global
from input_pipeline.packed import PackedBatch, field_shapes, fields, pack
from input_pipeline.packing import BatchBlocks
from trainer import sharding
from trainer.config import MeshConfig


def packer_batch(rows=8, length=16):
    """Fields laid out the way the concat packer lays them out, with distinct values."""
    blocks = BatchBlocks(rows * length)
    batch = {name: a.reshape(rows, length) for name, a in blocks.take().items()}
    rng = np.random.default_rng(0)
    for array in batch.values():
        array[:] = rng.integers(0, VOCAB, array.shape).astype(array.dtype)
    batch["weights"][:, -2:] = 0.5
    return batch


def test_the_packers_batch_packs_without_a_copy_and_unpacks_exactly():
    batch = packer_batch()
    packed = pack(batch)
    assert isinstance(packed, PackedBatch) and packed.block.shape == (5, 8, 16)
    assert all(np.shares_memory(packed.block, array) for array in batch.values())
    assert list(packed) == list(batch)
    for name, array in fields(packed).items():
        assert array.dtype == batch[name].dtype
        np.testing.assert_array_equal(array, batch[name])
    assert field_shapes(packed) == field_shapes(batch) == {name: (8, 16) for name in batch}


def test_separately_allocated_or_strided_fields_are_copied_into_the_block():
    rng = np.random.default_rng(1)
    wide = rng.integers(0, 9, (4, 12)).astype(np.int32)
    batch = {"a": wide[:, ::2], "b": rng.random((4, 6)).astype(np.float32)}  # a is strided
    packed = pack(batch)
    assert packed is not None and not np.shares_memory(packed.block, wide)
    np.testing.assert_array_equal(packed["a"], batch["a"])
    np.testing.assert_array_equal(packed["b"], batch["b"])


@pytest.mark.parametrize(
    "batch",
    [
        {"x": np.zeros((4, 3), np.float32), "y": np.zeros((4,), np.int32)},  # shapes differ
        {"x": np.zeros((4, 3), np.int64)},  # 8-byte numbers
        {"x": np.zeros((4, 3), np.float16)},  # 2-byte numbers
        {},
    ],
)
def test_batches_that_do_not_pack_stay_dicts(batch):
    assert pack(batch) is None


def test_placed_block_rows_are_sharded_like_a_fields_rows():
    mesh = sharding.make_mesh(MeshConfig(data=4, fsdp=2, tensor=1))
    batch = packer_batch()
    placed = to_global(pack(batch), sharding.batch_sharding(mesh))
    assert placed.block.sharding.spec == PartitionSpec(None, ("data", "fsdp"))
    assert len(placed.block.addressable_shards) == 8
    for name, array in fields(placed).items():  # outside jit: sliced on the devices
        assert array.dtype == batch[name].dtype
        np.testing.assert_array_equal(np.asarray(array), batch[name])


def test_packed_feed_yields_packed_batches_and_passes_unpackable_ones_as_dicts():
    mesh = sharding.make_mesh(MeshConfig(data=-1))
    odd = {"x": np.zeros((8, 3), np.float32), "y": np.zeros((8,), np.int32)}
    batches = iter([packer_batch(), odd])
    with DeviceFeed(batches, sharding.batch_sharding(mesh), packed=True) as feed:
        first, _ = next(feed)
        second, _ = next(feed)
    assert isinstance(first, PackedBatch)
    assert isinstance(second, dict) and second["y"].shape == (8,)


def test_the_step_on_a_packed_batch_equals_the_step_on_the_dict():
    """Same losses, gradients and parameters to the bit, on a 4x2 data x fsdp mesh."""
    program = program_for((4, 2, 1))
    batches = random_batches(3)
    with jax.set_mesh(program.mesh):
        results = []
        for packed in (False, True):
            state, losses = program.init(), []
            for batch in batches:
                host = pack(batch) if packed else batch
                placed = to_global(host, program.batch_sharding)
                assert isinstance(placed, PackedBatch) == packed
                state, metrics = program.train_step(state, placed)
                losses.append(np.asarray(metrics["loss"]))
            evaluated = program.eval_step(state, to_global(host, program.batch_sharding))
            results.append((losses, jax.tree.leaves(state), evaluated))
    (dict_losses, dict_state, dict_eval), (packed_losses, packed_state, packed_eval) = results
    np.testing.assert_array_equal(dict_losses, packed_losses)
    for a, b in zip(dict_state, packed_state, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for key in dict_eval:
        np.testing.assert_array_equal(np.asarray(dict_eval[key]), np.asarray(packed_eval[key]))
