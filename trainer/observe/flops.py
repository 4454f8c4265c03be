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


def flops_per_token(
    config: Config, num_params: int, vocab_size: int, builtin_transformer: bool = True
) -> float:
    """Training FLOPs per token (or example): 6 per parameter (forward + backward) for any model;
    for the built-in transformer, embedding lookups are free and attention adds
    12 * layers * width * context (the PaLM appendix formula)."""
    if not builtin_transformer:
        return 6.0 * num_params
    model = config.model
    lookup = 0 if model.tie_embeddings else vocab_size * model.d_model  # tied: also the output
    dense = 6.0 * (num_params - lookup)
    # attention width: the query heads' (d_model, unless model.head_dim sets it apart)
    width = model.num_heads * model.head_dim if model.head_dim else model.d_model
    return dense + 12.0 * model.num_layers * width * config.data.seq_len


def device_peak_tflops(override: float | None = None) -> float | None:
    """Peak of the local device kind, or the config's `log.peak_tflops`; None when unknown."""
    if override:
        return override
    kind = jax.devices()[0].device_kind.lower()
    for name, peak in sorted(PEAK_TFLOPS_BF16.items(), key=lambda kv: -len(kv[0])):
        if name in kind:
            return peak
    return None
