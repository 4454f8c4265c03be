"""The changes `trainer.plan` tries on a config that does not fit, cheapest first by a modelled
step-time cost (`trainer.plan.cost`): pure override lists, so their generation and order are
tested without compiling anything."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainer.config import Config
from trainer.data import check_batch_layout
from trainer.errors import ConfigError
from trainer.models import model_spec
from trainer.parallel.sharding import mesh_shape

MAX_DOUBLINGS = 6
REMAT_STRENGTH = {"none": 0, "save_dots": 1, "offload_dots": 2, "full": 2}
# Not tried: model.remat=offload_dots. XLA:CPU counts host-offloaded activations among its
# temporaries (its host and device memory are one), so a CPU compile cannot show that saving.


@dataclass(frozen=True)
class Step:
    """One knob turned: `knob` groups the steps that exclude each other (one remat, one mesh)."""

    knob: str
    overrides: tuple[str, ...]

    def settings(self) -> dict[str, str]:
        """The overrides as key -> value."""
        return dict(o.split("=", 1) for o in self.overrides)


def knob_steps(config: Config, devices: int) -> list[Step]:
    """Every single step that could lower the per-device memory of `config` on `devices`; a
    step that breaks the batch layout is left out (`trainer.data.check_batch_layout`)."""
    stage, data, fsdp, tensor = mesh_shape(config.mesh, devices)
    remat = REMAT_STRENGTH[config.model.remat]
    steps = [
        Step("remat", (f"model.remat={kind}",))
        for kind in ("save_dots", "full")
        if REMAT_STRENGTH[kind] > remat
    ]
    steps += [Step("mesh", _mesh(stage, data // k, fsdp * k, tensor)) for k in _doublings(data)]
    accum = config.optim.accum_steps
    microbatches = config.pipeline_microbatches if stage > 1 else 1
    for k in _doublings(config.data.global_batch_size):
        try:
            check_batch_layout(
                config.data.global_batch_size, accum * k, data * fsdp, 1, microbatches
            )
        except ConfigError:
            break
        steps.append(Step("accum", (f"optim.accum_steps={accum * k}",)))
    if not config.optim.offload:
        steps.append(Step("offload", ("optim.offload=true",)))
    if not config.model.offload_params:
        steps.append(Step("offload_params", ("model.offload_params=true",)))
    if model_spec(config.model.kind).pipelined:
        steps += _stage_steps(config, stage, data, fsdp, tensor)
    return steps


def _stage_steps(config: Config, stage: int, data: int, fsdp: int, tensor: int) -> list[Step]:
    """More pipeline stages, their devices taken from data parallelism first, then from fsdp."""
    steps = []
    for k in _doublings(config.model.num_layers // stage):
        if config.model.num_layers % (stage * k):
            break
        if data % k == 0:
            mesh = _mesh(stage * k, data // k, fsdp, tensor)
        elif fsdp % k == 0:
            mesh = _mesh(stage * k, data, fsdp // k, tensor)
        else:
            break
        explicit = config.pipeline.microbatches
        more = (
            (f"pipeline.microbatches={2 * stage * k}",) if explicit and explicit < stage * k else ()
        )
        steps.append(Step("stage", mesh + more))
    return steps


def changes(steps: list[Step], cost: Callable[[Step], float]) -> list[tuple[Step, ...]]:
    """Single steps and pairs of steps on different knobs, by summed `cost` (a single first)."""
    pairs = [
        (a, b)
        for i, a in enumerate(steps)
        for b in steps[i + 1 :]
        if a.knob != b.knob and not _keys(a) & _keys(b)
    ]
    both = [(s,) for s in steps] + pairs
    return sorted(both, key=lambda change: (sum(cost(s) for s in change), len(change)))


def overrides_of(change: tuple[Step, ...]) -> list[str]:
    return [o for step in change for o in step.overrides]


def _keys(step: Step) -> set[str]:
    return {o.partition("=")[0] for o in step.overrides}


def _doublings(limit: int) -> list[int]:
    """2, 4, 8, ... up to `limit` and at most MAX_DOUBLINGS of them."""
    return [2**i for i in range(1, MAX_DOUBLINGS + 1) if 2**i <= limit]


def _mesh(stage: int, data: int, fsdp: int, tensor: int) -> tuple[str, ...]:
    """Every axis pinned, so no -1 axis absorbs the change."""
    sizes = {"stage": stage, "data": data, "fsdp": fsdp, "tensor": tensor}
    return tuple(f"mesh.{axis}={size}" for axis, size in sizes.items())
