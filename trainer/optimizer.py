"""AdamW with linear warmup, a decay schedule, and global-norm clipping, built from `optim.*`."""

from __future__ import annotations

import jax
import optax
from jax.sharding import PartitionSpec

from trainer.config import OptimConfig


def make_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    """Warmup from 0 to `lr`, then cosine/linear decay to `min_lr` over `decay_steps`."""
    decay_steps = config.decay_steps or total_steps
    warmup = min(config.warmup_steps, max(decay_steps - 1, 0))
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, config.lr, warmup, max(decay_steps, warmup + 1), end_value=config.min_lr
        )
    if config.schedule == "constant":
        after = optax.constant_schedule(config.lr)
    else:
        after = optax.linear_schedule(config.lr, config.min_lr, max(decay_steps - warmup, 1))
    return optax.join_schedules(
        [optax.linear_schedule(0.0, config.lr, max(warmup, 1)), after], [warmup]
    )


def stretched_schedule_warning(
    config: OptimConfig, steps_then: int, steps_now: int, step: int
) -> str | None:
    """The line for a resume whose new `run.steps` moves the schedule under it (its decay spans
    `run.steps` while `decay_steps` is unset), so the learning rate jumps at `step`; None when it
    does not move."""
    if config.decay_steps is not None or steps_then == steps_now:
        return None
    then = float(make_schedule(config, steps_then)(step))
    now = float(make_schedule(config, steps_now)(step))
    if abs(now - then) <= 1e-6 * max(abs(then), abs(now)):
        return None
    return (
        f"warning: run.steps {steps_then} -> {steps_now} with optim.decay_steps unset stretches "
        f"the {config.schedule} schedule over {steps_now} steps: the learning rate at step {step} "
        f"is {now:.3g} where the saved run's schedule gave {then:.3g}; set "
        f"optim.decay_steps={steps_then} to keep that schedule"
    )


def decay_mask(logical_specs) -> object:
    """Weight decay on matrices only: norm scales and biases (one non-layer axis) are exempt."""

    def is_matrix(spec: PartitionSpec) -> bool:
        return sum(axis != "layers" for axis in spec) >= 2

    return jax.tree.map(is_matrix, logical_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def make_optimizer(
    config: OptimConfig, total_steps: int, mask=None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer, and its schedule apart: the step reports the learning rate."""
    schedule = make_schedule(config, total_steps)
    parts = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm else []
    parts.append(
        optax.adamw(
            schedule,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=mask,
        )
    )
    return optax.chain(*parts), schedule
