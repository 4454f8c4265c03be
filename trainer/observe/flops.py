"""Model FLOPs utilization: the peak FLOP/s per device (a model's FLOPs per token come from its
`ModelSpec`, `trainer/models/spec.py`)."""

from __future__ import annotations

import jax

# Dense bf16 peak TFLOP/s per device (vendor datasheets; no sparsity).
PEAK_TFLOPS_BF16 = {
    "h100": 989.0,
    "h200": 989.0,
    "a100": 312.0,
    "tpu v4": 275.0,
    "tpu v5 lite": 197.0,  # v5e reports itself as "TPU v5 lite"
    "tpu v5e": 197.0,
    "tpu v5p": 459.0,
    "tpu v5": 459.0,
}


def device_peak_tflops(override: float | None = None) -> float | None:
    """Peak of the local device kind, or the config's `log.peak_tflops`; None when unknown."""
    if override:
        return override
    kind = jax.devices()[0].device_kind.lower()
    for name, peak in sorted(PEAK_TFLOPS_BF16.items(), key=lambda kv: -len(kv[0])):
        if name in kind:
            return peak
    return None
