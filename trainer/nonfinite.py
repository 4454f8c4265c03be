"""The stop a non-finite step ends the run with: one line naming its likeliest cause and the fix,
before anything is saved. It reads a step's batch only when that step already failed, so a run
pays nothing per step for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from trainer.errors import TrainingError
from trainer.step import Batch

NOT_SAVED = "it is not saved (earlier checkpoints are kept)"


@dataclass(frozen=True)
class NonFiniteStop:
    """When a step's NaN/Inf stops the run (`optim.skip_nonfinite`, float16's loss-scale floor)
    and, where the model's vocabulary is known, whether its batch's token ids are the cause."""

    skip_nonfinite: bool = False
    loss_scale_min: float = 1.0
    vocab_size: int | None = None  # None: unknown (a caller's module without a `vocab` axis)

    def check(self, step: int, metrics: dict[str, float], batch: Batch | None) -> None:
        """Raise the run's last line if step `step` (its read `metrics`) must stop the run."""
        loss = metrics["loss"]
        if "loss_scale" in metrics and metrics["skipped"]:  # float16: skipped, the scale shrinks
            floor = self.loss_scale_min
            if metrics["loss_scale"] > floor:
                return  # not applied; the next step retries at half the scale
            self._check_token_ids(step, loss, batch)
            raise TrainingError(
                f"float16 gradients overflowed at step {step} even at the minimum loss scale "
                f"(precision.loss_scale_min={floor:g}); {NOT_SAVED}. Lower optim.lr, or train "
                "in precision.compute=bfloat16 (GPUs with bf16) or float32 (a re-run with "
                "either resumes from the last checkpoint)"
            )
        if self.skip_nonfinite or (np.isfinite(loss) and metrics["params_finite"] == 1.0):
            return
        self._check_token_ids(step, loss, batch)
        what = f"loss is {loss}" if not np.isfinite(loss) else "parameters became non-finite"
        raise TrainingError(
            f"{what} at step {step}; {NOT_SAVED}. Lower optim.lr, check the data (token ids must "
            "be below the model's vocabulary), use precision.compute=float32, or set "
            "optim.skip_nonfinite=true to skip such steps"
        )

    def _check_token_ids(self, step: int, loss: float, batch: Batch | None) -> None:
        """Ids outside the vocabulary in a NaN step's batch (this process's rows) are its
        certain cause: named, with the fix."""
        vocab = self.vocab_size
        if np.isfinite(loss) or vocab is None or batch is None:
            return
        if outside := token_ids_outside(batch, vocab):
            raise TrainingError(
                f"step {step}'s batch holds token ids {outside}, outside "
                f"model.vocab_size={vocab}, and its loss is {loss}; {NOT_SAVED}. Keep every "
                f"token id in [0, {vocab}) (check the data's tokenizer), or raise "
                "model.vocab_size to cover them"
            )


def checked_vocab_size(vocab: int, param_specs: Any, shapes: dict[str, list[int]]) -> int | None:
    """`vocab` (the run's recorded vocabulary) if a parameter has an axis named 'vocab' of that
    size (`param_specs`' logical axes, `shapes` by keystr path); else None: a caller's own
    module is not built from model.vocab_size, so that number would blame ids that a NaN from
    the learning rate happened to meet."""
    specs = jax.tree_util.tree_flatten_with_path(
        param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )[0]
    for path, spec in specs:
        shape = shapes.get(jax.tree_util.keystr(path), ())
        if any(axis == "vocab" and n == vocab for axis, n in zip(spec, shape, strict=False)):
            return vocab
    return None


def token_ids_outside(batch: Batch, vocab: int) -> str:
    """Where `batch`'s token ids (`inputs`, `targets`; this process's rows) leave [0, vocab):
    e.g. "up to 70 in 'inputs'"; empty when they do not."""
    found = []
    for name in ("inputs", "targets"):
        array = batch.get(name)
        if array is None or not np.issubdtype(array.dtype, np.integer):
            continue
        ids = np.concatenate([np.asarray(s.data).ravel() for s in array.addressable_shards])
        if not ids.size:
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 and high >= vocab:
            found.append(f"from {low} to {high} in {name!r}")
        elif high >= vocab:
            found.append(f"up to {high} in {name!r}")
        elif low < 0:
            found.append(f"down to {low} in {name!r}")
    return " and ".join(found)
