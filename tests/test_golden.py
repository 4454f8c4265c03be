"""Golden numbers (nanodo style): one train step of the tiny model on a fixed batch gives the
stored loss, gradient norm and parameter checksums, so a refactor that silently changes the math
(init, model, loss, optimizer) fails here even when every loss still goes down.

Float32 compute on one device, to keep the numbers stable across CPUs; the mesh layouts are
checked against each other in tests/test_step.py.
"""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TINY

from trainer.config import load_config
from trainer.models import builder_for_vocab
from trainer.parallel import sharding
from trainer.program import build_program

GOLDEN = Path(__file__).parent / "golden" / "tiny_step.json"
VOCAB, ROWS, LENGTH = 64, 16, 64
RTOL = 1e-5
HOW_TO_UPDATE = (
    f"one train step no longer gives the numbers in {GOLDEN.name}. Update them only for an "
    "intended change to the model, its init, the loss or the optimizer — never to make a "
    "refactor pass: a refactor must reproduce them. To update: UPDATE_GOLDEN=1 python -m pytest "
    "tests/test_golden.py, and say in the commit message why the numbers moved."
)


def fixed_batch() -> dict[str, np.ndarray]:
    """Seeded tokens, two documents per row and zero-weight padding at the end."""
    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, VOCAB, (ROWS, LENGTH + 1)).astype(np.int32)
    segment_ids = np.ones((ROWS, LENGTH), np.int32)
    segment_ids[:, LENGTH // 3 :] = 2
    segment_ids[:, -5:] = 0
    starts = np.where(segment_ids[0] == 2)[0][0]
    positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (ROWS, LENGTH)).copy()
    positions[:, starts:] -= starts
    positions[segment_ids == 0] = 0
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": segment_ids,
        "positions": positions,
        "weights": (segment_ids > 0).astype(np.float32),
    }


def abs_sum(params) -> float:
    """A parameter checksum: the sum of |p| over every leaf, accumulated in float64."""
    return float(sum(np.abs(np.asarray(x, np.float64)).sum() for x in jax.tree.leaves(params)))


def host_copy(params) -> list[np.ndarray]:
    """The leaves in float64 on the host: the step donates the state it is given."""
    return [np.array(x, np.float64) for x in jax.tree.leaves(params)]


def one_step() -> dict[str, float]:
    """The numbers of one train step of the tiny model, float32, on one device."""
    config = load_config(
        None,
        [
            *TINY,
            f"data.seq_len={LENGTH}",
            f"data.global_batch_size={ROWS}",
            "optim.warmup_steps=0",  # a non-zero learning rate at step 0: the update counts
            "precision.compute=float32",
            "precision.params=float32",
            "mesh.data=1",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            "run.seed=0",
        ],
    )
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    program = build_program(config, mesh, builder_for_vocab(config, VOCAB))
    state = program.init()
    before = host_copy(state.params)
    with jax.set_mesh(program.mesh):
        batch = jax.device_put(fixed_batch(), program.batch_sharding)
        state, metrics = program.train_step(state, batch)
    assert float(metrics["lr"]) > 0, "the step must apply an update for the checksum to mean much"
    return {
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "init_param_abs_sum": abs_sum(before),
        "param_abs_sum": abs_sum(state.params),
        # The update alone: a small change to it would hide in the size of the parameters.
        "update_abs_sum": float(
            sum(np.abs(a - b).sum() for a, b in zip(host_copy(state.params), before, strict=True))
        ),
    }


def test_one_train_step_matches_the_stored_numbers():
    got = one_step()
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
        pytest.skip(f"rewrote {GOLDEN}; review the diff and commit it with the reason")
    want = json.loads(GOLDEN.read_text())
    assert set(got) == set(want), HOW_TO_UPDATE
    mismatched = {
        k: (got[k], want[k]) for k in want if not np.isclose(got[k], want[k], rtol=RTOL, atol=0)
    }
    assert not mismatched, f"{HOW_TO_UPDATE}\n(got, stored): {mismatched}"
