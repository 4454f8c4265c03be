"""Rotary frequency scaling of long-context checkpoints (`model.rope_scaling`), computed as
Hugging Face's `transformers` does, so imported Llama 3.1/3.2 weights give the same logits."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from trainer.hf.config import split_rope_scaling

# A hashable form of `model.rope_scaling` (the model spec lives in a static graph definition).
RopeScaling = tuple[tuple[str, Any], ...]


def freeze_scaling(scaling: Mapping[str, Any] | None) -> RopeScaling | None:
    """The config's dict as sorted items, with its type under one key (`type`)."""
    if not scaling:
        return None
    kind, params = split_rope_scaling(scaling, "model.rope_scaling")
    return tuple(sorted({**params, "type": kind}.items()))


def scale_frequencies(freqs_F: jnp.ndarray, scaling: RopeScaling | None) -> jnp.ndarray:
    """Inverse frequencies `theta^(-2i/d)` rescaled by `linear` or `llama3` scaling."""
    if scaling is None:
        return freqs_F
    params = dict(scaling)
    factor = float(params["factor"])
    if params["type"] == "linear":
        return freqs_F / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    wavelen_F = 2 * math.pi / freqs_F
    scaled_F = jnp.where(wavelen_F > old_context / low, freqs_F / factor, freqs_F)
    smooth_F = (old_context / wavelen_F - low) / (high - low)
    smoothed_F = (1 - smooth_F) * scaled_F / factor + smooth_F * scaled_F
    medium_F = ~(wavelen_F < old_context / high) & ~(wavelen_F > old_context / low)
    return jnp.where(medium_F, smoothed_F, scaled_F)
