"""The batch every step benchmark feeds: random tokens, one document per row, no padding."""

from __future__ import annotations

import numpy as np

from trainer.config import Config


def synthetic_batch(config: Config, vocab_size: int) -> dict[str, np.ndarray]:
    B, L = config.data.global_batch_size, config.data.seq_len
    tokens = np.random.default_rng(0).integers(0, vocab_size, (B, L + 1)).astype(np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.ones((B, L), np.int32),
        "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
        "weights": np.ones((B, L), np.float32),
    }
