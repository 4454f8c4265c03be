"""The train state and its sharded initialization.

Three moves, never materializing anything replicated: abstract shapes (`nnx.eval_shape`),
shardings from the logical axis names, then one jitted init that writes straight into the
sharded layout. Parameters travel as plain nested dicts of arrays, so Orbax, optax and the
export path see ordinary pytrees; `nnx.merge(graphdef, params, rest)` rebuilds the module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.errors import ConfigError
from trainer.loss_scale import LossScale, LossScaling
from trainer.parallel import sharding

PyTree = Any


@struct.dataclass
class TrainState:
    """Everything a step reads and writes; a pure pytree of (sharded) arrays."""

    step: jax.Array
    params: PyTree
    model_state: PyTree  # non-parameter module state, e.g. a dropout RNG stream
    opt_state: PyTree
    loss_scale: LossScale | None = None  # float16 compute only (`trainer.loss_scale`)


@dataclass(frozen=True)
class ModelSkeleton:
    """What the step needs to rebuild the module, and how each piece is laid out on the mesh."""

    graphdef: nnx.GraphDef
    param_specs: PyTree  # logical PartitionSpecs, same tree as params
    param_shardings: PyTree
    model_state_shardings: PyTree
    logical_axes: frozenset[str]  # every axis name the parameters and model state use

    def merge(self, params: PyTree, model_state: PyTree) -> nnx.Module:
        return nnx.merge(self.graphdef, params, model_state)


def _logical_specs(state: nnx.State) -> PyTree:
    return nnx.to_pure_dict(nnx.get_partition_spec(state))


def abstract_model(
    build: Callable[..., nnx.Module], mesh: Mesh, rules
) -> tuple[ModelSkeleton, PyTree, PyTree]:
    """Shapes, logical specs and shardings of a model, without allocating its weights."""

    def split():
        with nnx.use_eager_sharding(False):
            model = build(rngs=nnx.Rngs(0))
        if not isinstance(model, nnx.Module):
            raise ConfigError(
                f"the model factory returned {type(model).__name__}, not an nnx.Module; "
                "return the module it builds"
            )
        return nnx.split(model, nnx.Param, ...)

    # jax.eval_shape, not nnx.eval_shape: the latter resolves logical names against the mesh.
    graphdef, params, rest = jax.eval_shape(split)  # a GraphDef is static: it comes out whole
    param_specs = _logical_specs(params)
    to_mesh = lambda spec: NamedSharding(mesh, sharding.logical_to_mesh(spec, rules))  # noqa: E731
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    rest_specs = _logical_specs(rest)
    param_shardings = jax.tree.map(to_mesh, param_specs, is_leaf=is_spec)
    model_state_shardings = jax.tree.map(to_mesh, rest_specs, is_leaf=is_spec)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    check_divisible("parameter", params, param_specs, param_shardings)
    check_divisible("model state", rest, rest_specs, model_state_shardings)
    skeleton = ModelSkeleton(
        graphdef=graphdef,
        param_specs=param_specs,
        param_shardings=param_shardings,
        model_state_shardings=model_state_shardings,
        logical_axes=frozenset(
            name
            for spec in jax.tree.leaves((param_specs, rest_specs), is_leaf=is_spec)
            for axis in spec
            for name in sharding.spec_names(axis)
        ),
    )
    return skeleton, params, rest


def check_divisible(kind: str, shapes: PyTree, logical_specs: PyTree, shardings: PyTree) -> None:
    """Every dimension splits evenly over its mesh axes, checked once at setup: otherwise the
    sharded init stops in a JAX traceback. The optimizer state and the offloaded copies follow
    these shardings, so this covers them too. The line names one parameter per logical axis at
    fault, so that one run shows every fix."""
    problems: dict[tuple[str, ...], str] = {}  # a logical axis -> its first parameter's problem

    def check(path, logical: PartitionSpec, named: NamedSharding, shape) -> None:
        found = sharding.indivisible_axis(shape.shape, logical, named.spec, named.mesh.shape)
        if found is not None:
            names, problem = found
            where = jax.tree_util.keystr(path, simple=True, separator="/")
            problems.setdefault(names, f"{kind} {where} {tuple(shape.shape)}: {problem}")

    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    jax.tree_util.tree_map_with_path(check, logical_specs, shardings, shapes, is_leaf=is_spec)
    if problems:
        raise ConfigError("; also ".join(problems.values()))


def state_shardings(
    skeleton: ModelSkeleton,
    tx: optax.GradientTransformation,
    abstract_params: PyTree,
    mesh: Mesh,
    scaling: LossScaling | None = None,
) -> TrainState:
    """Optimizer moments follow their parameter's sharding (ZeRO-style); counters replicate."""
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    replicated = sharding.replicated(mesh)
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_opt,
        skeleton.param_shardings,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(
        step=replicated,
        params=skeleton.param_shardings,
        model_state=skeleton.model_state_shardings,
        opt_state=opt_shardings,
        loss_scale=None if scaling is None else jax.tree.map(lambda _: replicated, scaling.init()),
    )


def with_shardings(shapes: PyTree, shardings: PyTree) -> PyTree:
    """ShapeDtypeStructs with target shardings: a restore target for Orbax."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def make_init_fn(
    build: Callable[..., nnx.Module],
    tx: optax.GradientTransformation,
    seed: int,
    scaling: LossScaling | None = None,
) -> Callable[[], TrainState]:
    """A pure function building the initial state; jit it with the state shardings."""

    def init() -> TrainState:
        with nnx.use_eager_sharding(False):
            model = build(rngs=nnx.Rngs(seed))
        _, params, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            model_state=nnx.to_pure_dict(rest),
            opt_state=tx.init(params),
            loss_scale=None if scaling is None else scaling.init(),
        )

    return init
