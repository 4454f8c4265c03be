"""The device mesh and the one rules table that maps logical axis names to mesh axes.

Layers name their parameter axes logically (`embed`, `mlp`, `heads`, `kv`, `vocab`, `layers`);
which mesh axis shards each name is data (`mesh.rules` in the config), never code. The `stage`
axis comes first: pipeline stages talk least (one activation per microbatch), so they may sit
across the slowest links, between nodes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from trainer.config import MeshConfig
from trainer.errors import ConfigError

MESH_AXES = ("stage", "data", "fsdp", "tensor")
# A batch's rows split over every axis but `tensor`: each stage's devices hold their own rows, so
# the embedding, the output head and the loss run data-parallel over stages too. Inside the
# pipeline a microbatch's rows split over (data, fsdp) only; `stage` then indexes the stage.
BATCH_AXES = ("stage", "data", "fsdp")
STAGE_BATCH_AXES = ("data", "fsdp")

# FSDP shards every weight along its model-width axis; tensor parallelism splits attention heads
# and the MLP hidden axis (column-parallel in, row-parallel out); the stacked layer axis is cut
# into contiguous pipeline stages (a no-op at mesh.stage=1). Unlisted names are replicated.
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv": None,
    "vocab": "tensor",
    "layers": "stage",
    "norm": None,
}


def mesh_shape(config: MeshConfig, num_devices: int) -> tuple[int, ...]:
    """Resolve the one -1 axis and check the product matches the devices, naming the fix."""
    sizes = {axis: getattr(config, axis) for axis in MESH_AXES}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    fill = [k for k, v in sizes.items() if v == -1]
    if fill:
        if num_devices % fixed:
            divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
            raise ConfigError(
                f"mesh sizes {_fmt(sizes)} do not divide {num_devices} devices; "
                f"use sizes whose product divides {num_devices} (divisors: {divisors})"
            )
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            f"mesh {_fmt(sizes)} needs {fixed} devices but {num_devices} are present; "
            f"make {'*'.join(f'mesh.{k}' for k in _shown(sizes))} equal the device count, or "
            "set one axis to -1"
        )
    return tuple(sizes[axis] for axis in MESH_AXES)


def _shown(sizes: Mapping[str, int]) -> dict[str, int]:
    """The axes worth naming in a message: an unused pipeline axis is left out."""
    return {k: v for k, v in sizes.items() if k != "stage" or v != 1}


def _fmt(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"mesh.{k}={v}" for k, v in _shown(sizes).items())


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (stage, data, fsdp, tensor) mesh with Auto axes, so GSPMD annotations propagate."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(config, len(devices))
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def resolve_rules(overrides: Mapping[str, object] | None = None) -> dict[str, object]:
    """Default rules updated by the config's `mesh.rules`; mesh axes are checked by name."""
    rules: dict[str, object] = dict(DEFAULT_RULES)
    for name, target in (overrides or {}).items():
        targets = [target] if isinstance(target, str) else list(target or [])
        unknown = [t for t in targets if t not in MESH_AXES]
        if unknown:
            raise ConfigError(
                f"mesh.rules.{name}: {unknown[0]!r} is not a mesh axis; use one of {MESH_AXES}"
            )
        rules[name] = tuple(targets) if len(targets) > 1 else (targets[0] if targets else None)
    return rules


def check_rules_used(overrides: Mapping[str, object], logical_axes: frozenset[str]) -> None:
    """A `mesh.rules` key that no parameter uses (and no default names) shards nothing: a typo
    would silently leave the model unsharded."""
    unused = sorted(set(overrides) - logical_axes - set(DEFAULT_RULES))
    if unused:
        raise ConfigError(
            f"mesh.rules.{unused[0]} names no axis of this model's parameters; use one of "
            f"{', '.join(sorted(logical_axes - set(MESH_AXES)))}"
        )


def spec_names(entry: object) -> tuple[str, ...]:
    """One entry of a PartitionSpec, or a rule's target, as its names: None is none, a name is
    one, a tuple is several."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(name for name in entry if name is not None)


def logical_to_mesh(spec: PartitionSpec, rules: Mapping[str, object]) -> PartitionSpec:
    """Map a PartitionSpec of logical names to mesh axes; a mesh axis is used at most once."""
    used: set[str] = set()
    out = []
    for logical in spec:
        axes: list[str] = []
        for name in spec_names(logical):
            if name in MESH_AXES:  # already a mesh axis (user models may name them directly)
                target: object = name
            elif name in rules:
                target = rules[name]
            else:
                raise ConfigError(
                    f"parameter axis {name!r} has no sharding rule; add mesh.rules.{name}: "
                    "<fsdp|tensor|data|null> to the config"
                )
            for axis in spec_names(target):
                if axis not in used:
                    used.add(axis)
                    axes.append(axis)
        out.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return PartitionSpec(*out)


def indivisible_axis(
    shape: Sequence[int],
    logical: PartitionSpec,
    resolved: PartitionSpec,
    mesh_sizes: Mapping[str, int],
) -> tuple[tuple[str, ...], str] | None:
    """The first dimension of `shape` that its mesh axes (`resolved`, from the `logical` names)
    do not split evenly: its logical names, and the problem with its fixes; None when all divide.
    JAX would refuse it later, in a traceback that names no parameter."""
    for size, logical_entry, mesh_entry in zip(shape, logical, resolved, strict=False):
        axes = spec_names(mesh_entry)
        count = math.prod(mesh_sizes[axis] for axis in axes)
        if size % count == 0:
            continue
        names = spec_names(logical_entry)
        return names, (
            f"its {'+'.join(repr(n) for n in names)} axis ({size}) does not split over "
            f"{_over(axes, mesh_sizes)}; {_divisor_fix(axes, size)}, or {_rule_fix(names)}"
        )
    return None


def _over(axes: tuple[str, ...], mesh_sizes: Mapping[str, int]) -> str:
    """`mesh.tensor=2`, or for several axes their product and each size."""
    product = "*".join(f"mesh.{axis}" for axis in axes)
    each = ", ".join(f"mesh.{axis}={mesh_sizes[axis]}" for axis in axes)
    total = math.prod(mesh_sizes[axis] for axis in axes)
    return f"{product}={total}" if len(axes) == 1 else f"{product}={total} ({each})"


def _divisor_fix(axes: tuple[str, ...], size: int) -> str:
    if len(axes) == 1:
        return f"use a mesh.{axes[0]} that divides {size}"
    named = ", ".join(f"mesh.{axis}" for axis in axes[:-1]) + f" and mesh.{axes[-1]}"
    return f"use {named} whose product divides {size}"


def _rule_fix(names: tuple[str, ...]) -> str:
    """Unshard the dimension through its rule; a mesh axis the model names itself has none."""
    ruled = [name for name in names if name not in MESH_AXES]
    if not ruled:
        return (
            "name that axis in the model with a logical name mesh.rules maps (not the mesh axis "
            "itself)"
        )
    return f"map {' and '.join(ruled)} to null ({', '.join(f'mesh.rules.{n}=null' for n in ruled)})"


def rows_like_the_batch(x: jax.Array, axes: tuple[str, ...] = BATCH_AXES) -> jax.Array:
    """Keep an activation's rows split over the batch `axes` as the batch is, its other axes
    whole (the last one as GSPMD likes: logits over vocab shards). Left alone, GSPMD may follow
    an FSDP-sharded weight instead, split the model width and gather the batch: every device
    then holds every row's activations. Outside a mesh with those axes, `x` is returned as is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(axes) <= set(mesh.axis_names):
        return x
    rest = [None] * (x.ndim - 2) + [PartitionSpec.UNCONSTRAINED] * (x.ndim > 1)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes, *rest))


def microbatches(
    x: jax.Array,
    count: int,
    axes: tuple[str, ...] = BATCH_AXES,
    setting: str = "optim.accum_steps",
) -> jax.Array:
    """[B, ...] -> [count, B/count, ...] taking every count-th row, so each microbatch stays
    spread over all the `axes` devices instead of living on 1/count of them. `setting` is the
    config key that asks for `count`, named when B does not divide (a caller's own batches)."""
    if x.shape[0] % count:
        raise ConfigError(
            f"a batch of {x.shape[0]} rows does not split into {setting}={count} equal "
            f"microbatches; yield batches of a multiple of {count} rows, or change {setting}"
        )
    x = x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1)
    rest = [PartitionSpec.UNCONSTRAINED] * (x.ndim - 2)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(None, axes, *rest))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches split their leading axis over (stage, data, fsdp); each device group of the
    `tensor` axis sees its own rows."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
