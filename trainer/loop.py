"""The step loop: dispatch step t, then read step t-1's metrics (ready by then), so the host never
blocks on the device for bookkeeping; checkpoints, evals, stop requests and the goodput timing
sit around the step. Batches arrive already on the devices (`DeviceFeed`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from input_pipeline.device import DeviceFeed
from input_pipeline.packed import field_shapes
from trainer.checkpoint import Checkpointer
from trainer.config import Config
from trainer.data import DataSources
from trainer.errors import ConfigError, TrainingError
from trainer.goodput import Goodput, session_summary
from trainer.metrics import MetricsWriter
from trainer.preemption import StopRequest
from trainer.profiling import ProfileWindow
from trainer.program import TrainProgram
from trainer.save_overlap import SaveOverlap
from trainer.state import TrainState


@dataclass
class RunResult:
    """What `run` hands back: the final state and the last logged numbers."""

    state: TrainState
    step: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    eval_loss: float | None = None


def evaluate(config: Config, sources: DataSources, program: TrainProgram, state) -> float:
    """Mean held-out loss (per token, or per the loss's `weight`) over `eval.steps` batches."""
    loss_sum, weight = 0.0, 0.0
    feed = DeviceFeed(
        iter(sources.make_eval()), program.batch_sharding, config.data.prefetch, packed=True
    )
    with feed:
        for i, (batch, _) in enumerate(feed):
            if i >= config.eval.steps:
                break
            out = jax.device_get(program.eval_step(state, batch))
            loss_sum += float(out["loss_sum"])
            weight += float(out["weight"])
    if weight == 0:
        raise ConfigError(
            f"the eval data of {sources.description} yields no batch; lower "
            "data.global_batch_size or data.seq_len, or pass more eval data"
        )
    return loss_sum / weight


def _items_in(batch: Mapping[str, jax.Array]) -> int:
    """Tokens per global batch for token data (`inputs` [B, L]); examples otherwise."""
    shapes = field_shapes(batch)
    if len(shapes.get("inputs", ())) == 2:
        return int(np.prod(shapes["inputs"]))
    return int(next(iter(shapes.values()))[0])


@dataclass
class Loop:
    """The step loop and its bookkeeping; one instance per run."""

    config: Config
    sources: DataSources
    program: TrainProgram
    checkpointer: Checkpointer
    writer: MetricsWriter
    meta: dict[str, Any]
    flops_per_token: float = 0.0
    peak_tflops: float | None = None  # per device; None when the device kind is unknown
    skipped_steps: int = 0  # non-finite steps skipped so far (optim.skip_nonfinite)
    items_per_step: int = 0  # tokens (or examples) in one global batch, read off the first one
    goodput: Goodput = field(default_factory=Goodput)  # where the wall time goes

    def train(self, state: TrainState, start_step: int, train_iter) -> RunResult:
        config, total = self.config, self.config.run.steps
        result = RunResult(state=state, step=start_step)
        if start_step >= total:
            self.writer.message(
                f"run already at step {start_step} >= run.steps={total}; raise run.steps to "
                "train further"
            )
            return result
        window: list[float] = []
        pending = None  # (step, device metrics, step wall time, data wait) of the previous step
        tick = time.perf_counter()
        feed = DeviceFeed(
            train_iter, self.program.batch_sharding, prefetch=config.data.prefetch, packed=True
        )
        profile = ProfileWindow(Path(config.run.workdir) / "profile", config.log.profile_steps)
        timing = self.goodput.timing
        overlap = SaveOverlap(self.program)  # steps after a save leave the saved state alone
        with feed, StopRequest() as stop, profile:
            for step in range(start_step + 1, total + 1):
                try:
                    with timing("data_wait"):
                        batch, data_state = next(feed)
                except StopIteration:
                    raise TrainingError(
                        f"the training data ran out before step {step}; repeat it (e.g. "
                        "grain's .repeat()) or lower run.steps"
                    ) from None
                wait_s = feed.last_wait_s
                self.items_per_step = self.items_per_step or _items_in(batch)
                profile.before_step(step, state)
                with timing("step"):
                    state, metrics = overlap.step(state, batch)  # runs while we log t-1
                    if pending is not None:
                        self._record(pending, window, result)
                profile.after_step(step, metrics)
                now = time.perf_counter()
                step_time, tick = now - tick, now
                if stop.at_step(step) or step % config.checkpoint.every == 0 or step == total:
                    with timing("step"):  # waiting for the step's result is step time
                        self._check_finite(step, jax.device_get(metrics))  # never save a NaN
                    with timing("checkpoint"):
                        blocked = self.checkpointer.save(step, state, data_state, self.meta)
                        overlap.saving(state)
                    metrics = {**metrics, "ckpt_block_s": blocked}
                pending = (step, metrics, step_time, wait_s)
                evaluating = step % config.eval.every == 0 or step == total
                if evaluating and self.sources.make_eval is not None:
                    with timing("eval"):
                        result.eval_loss = evaluate(config, self.sources, self.program, state)
                    self.writer.write(step, {"eval_loss": result.eval_loss})
                if stop.requested:
                    break
            with timing("step"):
                self._record(pending, window, result, force=True)
        result.state, result.step = state, step
        if stop.requested:
            with timing("checkpoint"):
                self.checkpointer.wait()
            self.writer.message(
                f"stopped by {stop.signal_name} at step {step}; checkpoint saved in "
                f"{self.checkpointer.directory / str(step)}; re-run the same command to resume"
            )
        return result

    def summary(self, start_step: int, result: RunResult) -> dict[str, Any]:
        """This session's goodput breakdown, throughput, MFU and peak memory."""
        return session_summary(
            self.goodput,
            start_step=start_step,
            end_step=result.step,
            items_per_step=self.items_per_step,
            flops_per_token=self.flops_per_token,
            peak_tflops=self.peak_tflops,
            last_metrics=result.last_metrics,
            eval_loss=result.eval_loss,
        )

    def _check_finite(self, step: int, metrics: dict[str, Any]) -> None:
        if self.config.optim.skip_nonfinite:
            return
        loss = float(np.asarray(metrics["loss"]))
        if np.isfinite(loss) and float(np.asarray(metrics["params_finite"])) == 1.0:
            return
        what = f"loss is {loss}" if not np.isfinite(loss) else "parameters became non-finite"
        raise TrainingError(
            f"{what} at step {step}; the last good checkpoint is kept. Lower optim.lr, check "
            "the data, use precision.compute=float32, or set optim.skip_nonfinite=true to "
            "skip such steps"
        )

    def _record(self, pending, window: list[float], result: RunResult, force=False) -> None:
        """Fetch one finished step's metrics; check them; log every `log.every` steps."""
        step, device_metrics, step_time, wait_s = pending
        metrics = {k: float(np.asarray(v)) for k, v in jax.device_get(device_metrics).items()}
        self._check_finite(step, metrics)
        self.skipped_steps += int(metrics.get("skipped", 0.0))
        if np.isfinite(metrics["loss"]):
            window.append(metrics["loss"])
        if step % self.config.log.every and not force:
            return
        tokens = self.items_per_step
        row = {
            "loss": sum(window) / len(window) if window else float("nan"),
            "lr": metrics["lr"],
            "grad_norm": metrics["grad_norm"],
            "tokens_per_s": tokens / step_time,
            "step_time_s": step_time,
            "data_wait_frac": min(wait_s / step_time, 1.0),
        }
        tflops = row["tokens_per_s"] * self.flops_per_token / jax.device_count() / 1e12
        row["tflops_per_device"] = tflops
        if self.peak_tflops:
            row["mfu"] = tflops / self.peak_tflops
        if self.config.optim.skip_nonfinite:
            row["skipped_steps"] = self.skipped_steps
        if self.config.data.skip_corrupt and self.sources.skipped_records is not None:
            row["corrupt_records_skipped"] = self.sources.skipped_records()
        if "ckpt_block_s" in metrics:
            row["ckpt_block_s"] = metrics["ckpt_block_s"]
        row.update(self.goodput.metrics())
        window.clear()
        self.writer.write(step, row)
        result.last_metrics = row
