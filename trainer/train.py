"""The training run: a handful of named setup calls, then the loop.

The loop never blocks on the device for bookkeeping: it dispatches step t, then reads step t-1's
metrics, which are ready by then. Batches arrive already on the devices (`DeviceFeed`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from input_pipeline.corpora import resolve_dataset
from input_pipeline.dataset_info import DatasetInfo, load_dataset_info
from input_pipeline.device import DeviceFeed
from input_pipeline.pipeline import make_batch_iterator
from trainer import sharding
from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import Config
from trainer.errors import ConfigError, TrainingError
from trainer.flops import device_peak_tflops, flops_per_token
from trainer.metrics import MetricsWriter
from trainer.models import build_model
from trainer.preemption import StopRequest
from trainer.program import TrainProgram, build_program
from trainer.state import TrainState

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What `run` hands back: the final state and the last logged numbers."""

    state: TrainState
    step: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    eval_loss: float | None = None


# ----------------------------------------------------------------------------- setup


def load_dataset(config: Config) -> DatasetInfo:
    """The prepared dataset folder (built-in corpora are prepared on first use)."""
    return load_dataset_info(resolve_dataset(config.data.path, config.data.cache_dir))


def model_builder(config: Config, info: DatasetInfo):
    """`rngs -> nnx.Module` for the configured model, with the vocabulary checked."""
    vocab_size = config.model.vocab_size or info.vocab_size
    if vocab_size < info.vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the dataset's vocabulary "
            f"({info.vocab_size}); raise model.vocab_size or leave it unset"
        )
    return builder_for_vocab(config, vocab_size)


def builder_for_vocab(config: Config, vocab_size: int | None = None):
    return functools.partial(
        build_model,
        config.model,
        vocab_size=vocab_size or config.model.vocab_size,
        compute_dtype=config.precision.compute,
        param_dtype=config.precision.params,
    )


def make_train_iterator(config: Config, info: DatasetInfo):
    host_batch = _host_batch_size(config)
    return make_batch_iterator(
        info,
        "train",
        seq_len=config.data.seq_len,
        batch_size=host_batch,
        packing=config.data.packing,
        shuffle=config.data.shuffle,
        seed=config.run.seed,
        num_epochs=None,
        read_threads=config.data.read_threads,
        workers=config.data.workers,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        skip_corrupt=config.data.skip_corrupt,
    )


def _host_batch_size(config: Config) -> int:
    processes = jax.process_count()
    if config.data.global_batch_size % processes:
        raise ConfigError(
            f"data.global_batch_size={config.data.global_batch_size} is not divisible by "
            f"{processes} processes; use a multiple of {processes}"
        )
    return config.data.global_batch_size // processes


def check_batch_fits_mesh(config: Config, mesh) -> None:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    accum = config.optim.accum_steps
    micro = config.data.global_batch_size // accum
    if micro % shards:
        raise ConfigError(
            f"data.global_batch_size={config.data.global_batch_size} / optim.accum_steps="
            f"{accum} = {micro} rows do not split over mesh data*fsdp="
            f"{shards}; use a global batch that is a multiple of {shards * accum}"
        )


def run_metadata(config: Config, info: DatasetInfo, params: Any) -> dict[str, Any]:
    return {
        "config": config.to_dict(),
        "dataset_fingerprint": info.fingerprint,
        "vocab_size": config.model.vocab_size or info.vocab_size,
        "param_shapes": param_shapes(params),
    }


# ----------------------------------------------------------------------------- eval


def evaluate(config: Config, info: DatasetInfo, program: TrainProgram, state) -> float:
    """Mean held-out loss per token over the first `eval.steps` eval batches."""
    iterator = make_batch_iterator(
        info,
        "eval",
        seq_len=config.data.seq_len,
        batch_size=_host_batch_size(config),
        packing=config.data.packing,
        shuffle=False,
        num_epochs=1,
        read_threads=config.data.read_threads,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    loss_sum, weight = 0.0, 0.0
    with DeviceFeed(iterator, program.batch_sharding, prefetch=config.data.prefetch) as feed:
        for i, (batch, _) in enumerate(feed):
            if i >= config.eval.steps:
                break
            out = jax.device_get(program.eval_step(state, batch))
            loss_sum += float(out["loss_sum"])
            weight += float(out["weight"])
    if weight == 0:
        raise ConfigError(
            f"the eval split of {info.path} yields no batch of {config.data.global_batch_size}"
            f"x{config.data.seq_len} tokens; lower data.global_batch_size or data.seq_len"
        )
    return loss_sum / weight


# ----------------------------------------------------------------------------- run


def run(config: Config) -> RunResult:
    """Train `config` to `run.steps`, resuming from the workdir's latest checkpoint."""
    workdir = Path(config.run.workdir)
    primary = jax.process_index() == 0
    mesh = sharding.make_mesh(config.mesh)
    check_batch_fits_mesh(config, mesh)
    info = load_dataset(config)
    program = build_program(config, mesh, model_builder(config, info))
    if primary:
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / "config.yaml").write_text(config.to_yaml())
        except OSError as err:
            raise TrainingError(
                f"cannot write run.workdir={workdir}: {err.strerror}; choose a writable folder"
            ) from None
    checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
    train_iter = make_train_iterator(config, info)
    state, start_step = restore_or_init(config, checkpointer, program, train_iter)
    writer = MetricsWriter(
        workdir,
        total_steps=config.run.steps,
        start_step=start_step,
        tensorboard=config.log.tensorboard,
        progress=config.log.progress,
        enabled=primary,
    )
    if start_step:
        writer.message(
            f"resuming from {checkpointer.directory / str(start_step)} (step {start_step})"
        )
    else:
        writer.message(
            f"model: {program.num_params / 1e6:.2f}M parameters; mesh {dict(mesh.shape)}; "
            f"data {info.path}"
        )
    peak = device_peak_tflops(config.log.peak_tflops)
    vocab_size = config.model.vocab_size or info.vocab_size
    loop = Loop(
        config,
        info,
        program,
        checkpointer,
        writer,
        run_metadata(config, info, state.params),
        flops_per_token=flops_per_token(config, program.num_params, vocab_size),
        peak_tflops=peak,
    )
    try:
        with jax.set_mesh(mesh):
            return loop.train(state, start_step, train_iter)
    finally:
        checkpointer.close()
        writer.close()


def restore_or_init(config: Config, checkpointer: Checkpointer, program: TrainProgram, train_iter):
    """Latest complete checkpoint (state + data position), or a fresh sharded init."""
    step = checkpointer.latest_step()
    if step is None and config.checkpoint.init_from:
        return init_from(config.checkpoint.init_from, program), 0
    if step is None:
        return program.init(), 0
    state, data_state = checkpointer.restore(step, program.abstract_state())
    if data_state is not None:
        train_iter.set_state(data_state)
    return state, step


def init_from(path: str, program: TrainProgram) -> TrainState:
    """A fresh state whose parameters come from another run's latest checkpoint (fine-tuning):
    optimizer state, step and data position start anew."""
    source, step = Checkpointer.open_existing(path)
    try:
        params = source.restore_params(step, program.abstract_state().params)
    finally:
        source.close()
    return program.init().replace(params=params)


@dataclass
class Loop:
    """The step loop and its bookkeeping; one instance per run."""

    config: Config
    info: DatasetInfo
    program: TrainProgram
    checkpointer: Checkpointer
    writer: MetricsWriter
    meta: dict[str, Any]
    flops_per_token: float = 0.0
    peak_tflops: float | None = None  # per device; None when the device kind is unknown
    skipped_steps: int = 0  # non-finite steps skipped so far (optim.skip_nonfinite)

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
        feed = DeviceFeed(train_iter, self.program.batch_sharding, prefetch=config.data.prefetch)
        with feed, StopRequest() as stop:
            for step in range(start_step + 1, total + 1):
                batch, data_state = next(feed)
                wait_s = feed.last_wait_s
                state, metrics = self.program.train_step(state, batch)  # runs while we log t-1
                if pending is not None:
                    self._record(pending, window, result)
                now = time.perf_counter()
                step_time, tick = now - tick, now
                if step % config.checkpoint.every == 0 or step == total or stop.requested:
                    self._check_finite(step, jax.device_get(metrics))  # never save a NaN state
                    blocked = self.checkpointer.save(step, state, data_state, self.meta)
                    metrics = {**metrics, "ckpt_block_s": blocked}
                pending = (step, metrics, step_time, wait_s)
                if step % config.eval.every == 0 or step == total:
                    result.eval_loss = evaluate(config, self.info, self.program, state)
                    self.writer.write(step, {"eval_loss": result.eval_loss})
                if stop.requested:
                    break
            self._record(pending, window, result, force=True)
        result.state, result.step = state, step
        if stop.requested:
            self.checkpointer.wait()
            self.writer.message(
                f"stopped by {stop.signal_name} at step {step}; checkpoint saved in "
                f"{self.checkpointer.directory / str(step)}; re-run the same command to resume"
            )
        return result

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
        tokens = self.config.data.global_batch_size * self.config.data.seq_len
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
        if "ckpt_block_s" in metrics:
            row["ckpt_block_s"] = metrics["ckpt_block_s"]
        window.clear()
        self.writer.write(step, row)
        result.last_metrics = row
