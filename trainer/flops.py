"""Model FLOPs utilization: FLOPs per token from the model shape, and peak FLOP/s per device."""

from __future__ import annotations

import jax

from trainer.config import Config

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


def flops_per_token(config: Config, num_params: int, vocab_size: int) -> float:
    """Training FLOPs per token: 6 per non-embedding-lookup parameter (forward + backward), plus
    attention scores and values, 12 * layers * width * context (the PaLM appendix formula)."""
    model = config.model
    lookup = vocab_size * model.d_model if model.kind == "transformer" else 0
    if model.kind == "transformer" and model.tie_embeddings:
        lookup = 0  # the tied table is also the output matmul, which does cost FLOPs
    dense = 6.0 * (num_params - lookup)
    if model.kind != "transformer":
        return dense
    return dense + 12.0 * model.num_layers * model.d_model * config.data.seq_len


def device_peak_tflops(override: float | None = None) -> float | None:
    """Peak of the local device kind, or the config's `log.peak_tflops`; None when unknown."""
    if override:
        return override
    kind = jax.devices()[0].device_kind.lower()
    for name, peak in sorted(PEAK_TFLOPS_BF16.items(), key=lambda kv: -len(kv[0])):
        if name in kind:
            return peak
    return None
