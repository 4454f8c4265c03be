"""Pipeline parallelism: the stacked layers cut into `stages` contiguous pieces over the `stage`
mesh axis, and microbatches flowing through them on a GPipe schedule, inside the one jitted step.

All stages run as one `vmap` over a leading stage axis that is sharded over the `stage` mesh
axis (the pattern MaxText uses), rather than as per-device code under `shard_map` + `ppermute`:
GSPMD gives each stage's devices their own layers and microbatch, and turns the shift from stage
s to s+1 between iterations into a collective permute. Everything stays in GSPMD, so the
data/fsdp/tensor rules, remat and accumulation apply inside a stage unchanged, and the
parameters keep their `[layers, ...]` layout (sharded over `stage` by the `layers` rule): a
checkpoint does not know the stage count it was saved with. Autodiff of the forward schedule is
the backward schedule (all forwards, then all backwards: GPipe).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from trainer.parallel.sharding import STAGE_BATCH_AXES, microbatches

PyTree = Any
ANY = PartitionSpec.UNCONSTRAINED


@dataclass(frozen=True)
class PipelineSpec:
    """How many stages the layer stack is cut into, and how many microbatches flow through."""

    stages: int
    microbatches: int

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.microbatches)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of a GPipe step: each stage waits `stages - 1` of the
    `microbatches + stages - 1` iterations, for the pipeline to fill and to drain."""
    return (stages - 1) / (microbatches + stages - 1)


def run_pipeline(
    stage_fn: Callable[[PyTree, jax.Array, PyTree, jax.Array], jax.Array],
    layers: PyTree,
    x_BxLxD: jax.Array,
    rows: PyTree,
    spec: PipelineSpec,
) -> jax.Array:
    """`x` through every layer, stage by stage: the same result as running the layers in order.

    `stage_fn(stage_layers, x_mb, rows_mb, microbatch)` runs one stage's layers (leading axis
    `layers / stages`) on one microbatch; `rows` are per-row inputs every layer reads (masks,
    rotary angles: leading axis B, or None); `microbatch` is the index it works on, outside
    `[0, microbatches)` while the pipeline fills or drains (its output is then discarded)."""
    S, M = spec.stages, spec.microbatches
    stage_layers = jax.tree.map(lambda a: _by_stage(a.reshape(S, -1, *a.shape[1:])), layers)
    # each microbatch spread over a stage's data-parallel devices (the rows other stages held
    # outside the pipeline are gathered here)
    split = lambda a: microbatches(a, M, STAGE_BATCH_AXES, "pipeline.microbatches")  # noqa: E731
    xs_MxBxLxD = split(x_BxLxD)
    rows_M = jax.tree.map(split, rows)
    stage_ids = jnp.arange(S)
    run_stages = jax.vmap(stage_fn, spmd_axis_name="stage")

    def iteration(carry, t):
        received_S, outputs_S = carry  # what each stage got from the one before; done outputs
        # stage 0 takes microbatch t; past the last one it recomputes it, and nobody reads that
        feed = xs_MxBxLxD[jnp.minimum(t, M - 1)]
        inputs_S = _by_stage(jnp.where((stage_ids == 0)[:, None, None, None], feed, received_S))
        microbatch_S = t - stage_ids
        picked = jnp.clip(microbatch_S, 0, M - 1)
        rows_S = jax.tree.map(lambda r: _by_stage(r[picked]), rows_M)
        out_S = _by_stage(run_stages(stage_layers, inputs_S, rows_S, microbatch_S))
        # Every stage files its output at its own microbatch's slot, on its own devices; only
        # the last stage's copy is read. There a filling iteration's output lands in slot 0
        # before the real one overwrites it, and draining never comes: its last real output is
        # the last iteration's. (Other stages' slot M-1 ends up holding drain garbage, unread.)
        outputs_S = jax.vmap(lambda o, y, m: o.at[m].set(y))(outputs_S, out_S, picked)
        return (jnp.roll(out_S, 1, axis=0), outputs_S), None

    received = _by_stage(jnp.zeros((S, *xs_MxBxLxD.shape[1:]), x_BxLxD.dtype))
    outputs = _by_stage(jnp.zeros((S, *xs_MxBxLxD.shape), x_BxLxD.dtype))
    (_, outputs), _ = jax.lax.scan(iteration, (received, outputs), jnp.arange(M + S - 1))
    return _rows_back(outputs[S - 1])


def _by_stage(x: jax.Array) -> jax.Array:
    """Leading axis over the `stage` mesh axis; the rest as GSPMD propagates it."""
    return jax.lax.with_sharding_constraint(x, PartitionSpec("stage", *([ANY] * (x.ndim - 1))))


def _rows_back(x: jax.Array) -> jax.Array:
    """The inverse of `microbatches`: [count, B/count, ...] -> [B, ...] in the original order."""
    x = x.swapaxes(0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
