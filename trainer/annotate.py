"""Name the parameter axes of a model you did not write, by regex on parameter paths.

    model = lambda rngs: trainer.annotate_axes(TheirModel(rngs), [
        (r".*/kernel", ("embed", "mlp")),
        (r".*/bias", ("mlp",)),
    ])

The names are logical (`embed`, `mlp`, `heads`, `kv`, `vocab`, `layers`, or a mesh axis);
`mesh.rules` maps them to mesh axes. Unmatched parameters keep their own annotation, or are
replicated when they have none.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from flax import nnx

from trainer.errors import ConfigError

AxisRule = tuple[str, Sequence[str | None]]


def annotate_axes(module: nnx.Module, rules: Sequence[AxisRule]) -> nnx.Module:
    """Set each parameter's logical axes from the first rule whose regex fully matches its
    `/`-joined path (e.g. `hidden/kernel`); returns the same module, annotated in place."""
    compiled = [(re.compile(pattern), tuple(axes)) for pattern, axes in rules]
    for path, variable in nnx.iter_graph(module):
        if not isinstance(variable, nnx.Param):
            continue
        name = "/".join(str(part) for part in path)
        for pattern, axes in compiled:
            if pattern.fullmatch(name):
                ndim = len(variable.get_value().shape)
                if len(axes) != ndim:
                    raise ConfigError(
                        f"axis rule {pattern.pattern!r} gives {len(axes)} names {axes} to "
                        f"parameter {name} of rank {ndim}; give one name (or None) per axis"
                    )
                variable.set_metadata(out_sharding=axes)
                break
    return module
