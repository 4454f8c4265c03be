"""Dynamic loss scaling for float16 compute (GPUs without fast bf16: RTX 20xx, V100, T4).

fp16 keeps 5 exponent bits: gradients below ~6e-8 flush to zero and the run silently stops
learning. The loss is multiplied by a large scale before the backward pass, so small gradients
stay representable, and the gradients are divided by it again before the update. A step whose
gradients overflowed is skipped and the scale halved; after `period` clean steps in a row it
doubles again, so it sits just below the largest value that does not overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import struct

from trainer.config import PrecisionConfig


def uses_loss_scale(compute: str) -> bool:
    """Whether `precision.compute` scales its loss: float16 only (so its state holds a scale)."""
    return compute == "float16"


@struct.dataclass
class LossScale:
    """The scale and its counter: part of the train state, so a resume continues exactly."""

    scale: jax.Array  # float32
    clean_steps: jax.Array  # int32: finite steps in a row since the last change


@dataclass(frozen=True)
class LossScaling:
    """The policy (`precision.loss_scale_*`): static numbers the compiled step closes over."""

    initial: float
    period: int
    minimum: float
    maximum: float

    @classmethod
    def from_config(cls, config: PrecisionConfig) -> LossScaling | None:
        """The policy for float16 compute; None for bf16 and fp32, which need none."""
        if not uses_loss_scale(config.compute):
            return None
        return cls(
            initial=config.loss_scale_init,
            period=config.loss_scale_period,
            minimum=config.loss_scale_min,
            maximum=config.loss_scale_max,
        )

    def init(self) -> LossScale:
        return LossScale(scale=jnp.float32(self.initial), clean_steps=jnp.int32(0))

    def update(self, state: LossScale, finite: jax.Array) -> LossScale:
        """Halve on a non-finite step; double after `period` finite ones; stay in bounds."""
        clean = jnp.where(finite, state.clean_steps + 1, 0)
        grow = clean >= self.period
        scale = jnp.where(finite, jnp.where(grow, state.scale * 2.0, state.scale), state.scale / 2)
        return LossScale(
            scale=jnp.clip(scale, self.minimum, self.maximum).astype(jnp.float32),
            clean_steps=jnp.where(grow, 0, clean).astype(jnp.int32),
        )
