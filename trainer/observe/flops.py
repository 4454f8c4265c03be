"""Model FLOPs utilization: the peak FLOP/s per device (a model's FLOPs per token come from its
`ModelSpec`, `trainer/models/spec.py`)."""

from __future__ import annotations

import re

import jax

# Dense 16-bit tensor peak TFLOP/s per device: bf16, or fp16 on a GPU without bf16 (Turing,
# Volta), with fp32 accumulation and no sparsity (vendor datasheets). Keyed by words of the
# device kind JAX reports; the GPU plan (`trainer.plan.gpu.GPUS`) reads its peaks here too.
PEAK_TFLOPS = {
    "h200": 989.0,
    "h100": 989.0,
    "h100 pcie": 756.0,
    "a100": 312.0,
    "l4": 121.0,
    "rtx 4090": 165.0,
    "rtx 3090": 71.0,
    "v100": 125.0,
    "t4": 65.0,
    "rtx 2080 ti": 53.8,
    "tpu v4": 275.0,
    "tpu v5 lite": 197.0,  # v5e reports itself as "TPU v5 lite"
    "tpu v5e": 197.0,
    "tpu v5p": 459.0,
    "tpu v5": 459.0,
    "tpu v6 lite": 918.0,  # v6e (Trillium)
    "tpu v6e": 918.0,
}


def peak_tflops_of(device_kind: str) -> float | None:
    """The table's peak for a device kind as JAX spells it ("NVIDIA GeForce RTX 2080 Ti"): the
    longest name found in it as whole words, so "tpu v5" is not read in "TPU v5p"."""
    kind = device_kind.lower()
    for name in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if re.search(rf"(?<![a-z0-9]){re.escape(name)}(?![a-z0-9])", kind):
            return PEAK_TFLOPS[name]
    return None


def device_peak_tflops(override: float | None = None) -> float | None:
    """Peak of the local device kind, or the config's `log.peak_tflops`; None when unknown."""
    if override:
        return override
    return peak_tflops_of(jax.devices()[0].device_kind)
