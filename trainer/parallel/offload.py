"""ZeRO-Offload: optimizer state (`optim.offload`) and fp32 master parameters
(`model.offload_params`) rest in pinned host memory between steps.

The one module that knows memory kinds. The state's shardings say where each leaf rests
(`at_rest`); the jitted step moves the resting-on-host leaves into device memory and the updated
ones back (`Offload`), so XLA schedules the copies; `device_bytes` reads a compiled step's
device-memory need. Checkpoints restore straight into the at-rest shardings.

What comes in when decides the peak. The forward and backward passes get only a compute-dtype copy
of the host-resting parameters' matrices (`Offload.forward_params`); the optimizer state and the
fp32 parameters come in for the update, behind an optimization barrier on the gradients, so XLA
cannot start their copies while the activations are alive (`Offload.to_device(after=grads)`).
Copied in at the start of the step, as before, they raised the step's temporaries by exactly the
bytes they took out of its arguments (issue 28: 42.3 GB peak either way on an H200).

XLA:CPU has one memory: it keeps the host-kind arguments and outputs but compiles the copies
inside a step (and remat offloads) to nothing, so on CPU only the at-rest placement is real;
`python -m trainer.plan --gpu NAME` compiles the step for a GPU to see the copies' effect.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import Recompute
from jax.sharding import Sharding

from trainer.errors import ConfigError

if TYPE_CHECKING:  # trainer.parallel.state builds its shardings with `at_rest`
    from trainer.config import PrecisionConfig
    from trainer.parallel.state import TrainState

PyTree = Any
DEVICE = "device"
HOST = "pinned_host"  # page-locked: the device copies it by DMA, without a staging buffer


def _on_host(sharding: Sharding | None) -> bool:
    return sharding is not None and sharding.memory_kind == HOST


def _in(kind: str, shardings: PyTree) -> PyTree:
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def at_rest(shardings: TrainState, *, params: bool, opt_state: bool) -> TrainState:
    """`shardings` with the parameters and/or the optimizer state (every leaf of it, counters
    included) in pinned host memory; step, model state and loss scale stay on the device."""
    for key, wanted in (("model.offload_params", params), ("optim.offload", opt_state)):
        if wanted:
            _check_host_memory(shardings.step, key)
    return shardings.replace(
        params=_in(HOST, shardings.params) if params else shardings.params,
        opt_state=_in(HOST, shardings.opt_state) if opt_state else shardings.opt_state,
    )


def _check_host_memory(sharding: Sharding, key: str) -> None:
    device = next(iter(sharding.device_set))
    kinds = sorted(memory.kind for memory in device.addressable_memories())
    if HOST not in kinds:
        raise ConfigError(
            f"{key}=true needs {HOST} memory, which {device.platform} devices lack (they have "
            f"{', '.join(kinds)}); set {key}=false"
        )


@dataclass(frozen=True)
class Offload:
    """Moves a state's host-resting leaves in and out inside a jitted step (what comes in when:
    the module docstring), so between steps and while activations are alive they take no device
    memory."""

    shardings: TrainState  # the at-rest shardings (`at_rest`) the step is jitted with
    narrowed: PyTree  # params tree of bools: leaves the forward gets in `compute_dtype`
    compute_dtype: Any
    master_dtype: Any  # the dtype of the parameters at rest, gradients and update

    @classmethod
    def of(
        cls, shardings: TrainState, precision: PrecisionConfig, matrices: PyTree
    ) -> Offload | None:
        """None when no leaf rests on the host: the step then compiles without any copy.
        `matrices` (a params tree of bools) marks the parameters every forward casts to the
        compute dtype anyway (the weight-decayed ones, `trainer.optimizer.decay_mask`): resting
        on the host, they travel to the forward already cast."""
        if not any(_on_host(s) for s in jax.tree.leaves(shardings)):
            return None
        cast = precision.compute != precision.params
        narrowed = jax.tree.map(
            lambda s, m: cast and bool(m) and _on_host(s), shardings.params, matrices
        )
        return cls(shardings, narrowed, jnp.dtype(precision.compute), jnp.dtype(precision.params))

    def forward_params(self, params: PyTree) -> PyTree:
        """Inside jit: the parameters the forward and backward passes read. Host-resting ones
        come into device memory, the `narrowed` ones in the compute dtype (the values the model's
        own cast gives); device-resting ones are returned untouched."""

        def fetch(x, s, narrow):
            if not _on_host(s):
                return x
            x = jax.device_put(x, s.with_memory_kind(DEVICE))
            return x.astype(self.compute_dtype) if narrow else x

        return jax.tree.map(fetch, params, self.shardings.params, self.narrowed)

    def widen(self, params: PyTree) -> PyTree:
        """`forward_params`' narrowed copies cast back to the master dtype. Applied to the values
        differentiated, so gradients come out and are summed in the master dtype, as without
        offload, while XLA folds the cast pair into the model's own cast: only the compute-dtype
        copy lives on the device."""
        return jax.tree.map(
            lambda x, narrow: x.astype(self.master_dtype) if narrow else x, params, self.narrowed
        )

    def to_device(self, state: TrainState, after: PyTree = None) -> TrainState:
        """Inside jit: every host-resting leaf copied into device memory, same layout. With
        `after` (the gradients), the copies wait for it behind an optimization barrier: XLA would
        otherwise start them early, while the backward pass's activations are alive."""
        leaves, treedef = jax.tree.flatten(state)
        shardings = treedef.flatten_up_to(self.shardings)
        resting = [i for i, s in enumerate(shardings) if _on_host(s)]
        moving = [leaves[i] for i in resting]
        if after is not None and moving:
            moving, _ = jax.lax.optimization_barrier((moving, after))
        for i, x in zip(resting, moving, strict=True):
            leaves[i] = jax.device_put(x, shardings[i].with_memory_kind(DEVICE))
        return treedef.unflatten(leaves)

    def to_host(self, state: TrainState) -> TrainState:
        """Inside jit: every leaf that rests on the host copied back into pinned host memory."""
        return jax.tree.map(
            lambda x, s: jax.device_put(x, s) if _on_host(s) else x, state, self.shardings
        )


def to_device_memory(arrays: PyTree) -> PyTree:
    """Concrete arrays with the host-resting ones copied into device memory: for code outside
    the step (sampling) that runs ordinary jitted ops on them."""
    return jax.tree.map(
        lambda x: (
            jax.device_put(x, x.sharding.with_memory_kind(DEVICE)) if _on_host(x.sharding) else x
        ),
        arrays,
    )


def device_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Bytes of device memory one device needs to run `compiled`, from XLA's memory analysis:
    arguments + outputs - donated (aliased) ones + temporaries, without those that live in host
    memory kinds. None when the backend gives no memory analysis.

    GPU/TPU XLA reports host-memory arguments and outputs in separate `host_*` fields; XLA:CPU
    counts them with the device ones, so there they are subtracted using the compiled input and
    output shardings (inputs the executable prunes as unused count for neither)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    arguments = stats.argument_size_in_bytes
    outputs = stats.output_size_in_bytes
    aliased = stats.alias_size_in_bytes
    if not (stats.host_argument_size_in_bytes or stats.host_output_size_in_bytes):
        none_is_leaf = lambda x: x is None  # noqa: E731  (a pruned input's sharding is None)
        shardings = jax.tree.leaves(compiled.input_shardings, is_leaf=none_is_leaf)
        infos = jax.tree.leaves(compiled.args_info, is_leaf=none_is_leaf)
        inputs = list(zip(shardings, infos, strict=True))
        host_out = _host_bytes((out.sharding, out) for out in jax.tree.leaves(compiled.out_info))
        arguments -= _host_bytes(inputs)
        outputs -= host_out
        host_donated = _host_bytes((s, x) for s, x in inputs if _on_host(s) and x.donated)
        aliased -= min(host_donated, host_out, aliased)
    return arguments + outputs - aliased + stats.temp_size_in_bytes


def _host_bytes(placed: Iterable[tuple[Sharding | None, Any]]) -> int:
    """Per-device bytes of the (sharding, shape and dtype) pairs that live in host memory."""
    return sum(
        math.prod(s.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize
        for s, x in placed
        if _on_host(s)
    )


def offload_dots_policy(*names: str) -> Callable[..., Any]:
    """A remat policy keeping what `model.remat=save_dots` keeps (matmuls without batch
    dimensions, and values tagged with one of `names`) in pinned host memory, not on the device.
    `save_from_both_policies` accepts boolean policies only, hence the explicit OR."""
    policies = jax.checkpoint_policies
    dots = policies.offload_dot_with_no_batch_dims(DEVICE, HOST)
    named = policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(names),
        offload_src=DEVICE,
        offload_dst=HOST,
    )

    def policy(prim, *args, **params):
        decision = dots(prim, *args, **params)
        return named(prim, *args, **params) if decision is Recompute else decision

    return policy
