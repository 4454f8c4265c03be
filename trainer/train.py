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
from trainer.metrics import MetricsWriter
from trainer.models import build_model
from trainer.optimizer import decay_mask, make_optimizer
from trainer.state import (
    TrainState,
    abstract_model,
    abstract_state,
    init_state,
    make_init_fn,
    state_shardings,
)
from trainer.step import jit_steps, make_eval_step, make_train_step, next_token_loss

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
    return functools.partial(
        build_model,
        config.model,
        vocab_size=vocab_size,
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
        "param_shapes": param_shapes(params),
    }


# ----------------------------------------------------------------------------- eval


def evaluate(config: Config, info: DatasetInfo, state, eval_step, batch_sharding) -> float:
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
    with DeviceFeed(iterator, batch_sharding, prefetch=config.data.prefetch) as feed:
        for i, (batch, _) in enumerate(feed):
            if i >= config.eval.steps:
                break
            out = jax.device_get(eval_step(state, batch))
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
    rules = sharding.resolve_rules(config.mesh.rules)
    info = load_dataset(config)
    build = model_builder(config, info)
    batch_sharding = sharding.batch_sharding(mesh)

    with jax.set_mesh(mesh):
        skeleton, abstract_params, _ = abstract_model(build, mesh, rules)
        tx, schedule = make_optimizer(
            config.optim, config.run.steps, mask=decay_mask(skeleton.param_specs)
        )
        shardings = state_shardings(skeleton, tx, abstract_params, mesh)
        init = make_init_fn(build, tx, config.run.seed)
        train_step, eval_step = jit_steps(
            make_train_step(skeleton, tx, schedule, next_token_loss, config.optim.accum_steps),
            make_eval_step(skeleton, next_token_loss),
            shardings,
            batch_sharding,
        )
        if primary:
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / "config.yaml").write_text(config.to_yaml())
        checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
        train_iter = make_train_iterator(config, info)
        state, start_step = restore_or_init(
            checkpointer, init, shardings, train_iter, log_fn=print if primary else None
        )
        meta = run_metadata(config, info, abstract_params)
        writer = MetricsWriter(
            workdir,
            total_steps=config.run.steps,
            start_step=start_step,
            tensorboard=config.log.tensorboard,
            progress=config.log.progress,
            enabled=primary,
        )
        if start_step == 0 and primary:
            writer.message(
                f"model: {skeleton.num_params(abstract_params) / 1e6:.2f}M parameters; "
                f"mesh {dict(mesh.shape)}; data {info.path}"
            )
        try:
            return _loop(
                config,
                info,
                state,
                start_step,
                train_step,
                eval_step,
                train_iter,
                batch_sharding,
                checkpointer,
                writer,
                meta,
            )
        finally:
            checkpointer.close()
            writer.close()


def restore_or_init(checkpointer: Checkpointer, init, shardings, train_iter, log_fn=None):
    """Latest complete checkpoint (state + data position), or a fresh sharded init."""
    step = checkpointer.latest_step()
    if step is None:
        return init_state(init, shardings), 0
    target = abstract_state(shardings, init)
    state, data_state = checkpointer.restore(step, target)
    if data_state is not None:
        train_iter.set_state(data_state)
    if log_fn:
        log_fn(f"resuming from checkpoint {checkpointer.directory / str(step)} (step {step})")
    return state, step


def _loop(
    config,
    info,
    state,
    start_step,
    train_step,
    eval_step,
    train_iter,
    batch_sharding,
    checkpointer,
    writer,
    meta,
) -> RunResult:
    total = config.run.steps
    tokens_per_step = config.data.global_batch_size * config.data.seq_len
    result = RunResult(state=state, step=start_step)
    window: list[float] = []
    pending = None  # (step, device metrics, step wall time, data wait) of the previous step
    tick = time.perf_counter()
    with DeviceFeed(train_iter, batch_sharding, prefetch=config.data.prefetch) as feed:
        for step in range(start_step + 1, total + 1):
            batch, data_state = next(feed)
            wait_s = feed.last_wait_s
            state, metrics = train_step(state, batch)  # dispatched; runs while we log t-1
            if pending is not None:
                _record(pending, window, writer, config, tokens_per_step, result)
            now = time.perf_counter()
            step_time, tick = now - tick, now
            if step % config.checkpoint.every == 0 or step == total:
                metrics = {
                    **metrics,
                    "ckpt_block_s": checkpointer.save(step, state, data_state, meta),
                }
            pending = (step, metrics, step_time, wait_s)
            if step % config.eval.every == 0 or step == total:
                result.eval_loss = evaluate(config, info, state, eval_step, batch_sharding)
                writer.write(step, {"eval_loss": result.eval_loss})
        if pending is not None:
            _record(pending, window, writer, config, tokens_per_step, result, force=True)
    result.state, result.step = state, total
    return result


def _record(pending, window, writer, config, tokens_per_step, result, force=False) -> None:
    """Fetch one finished step's metrics; check them; log every `log.every` steps."""
    step, device_metrics, step_time, wait_s = pending
    metrics = {k: float(np.asarray(v)) for k, v in jax.device_get(device_metrics).items()}
    if not np.isfinite(metrics["loss"]):
        raise TrainingError(
            f"loss is {metrics['loss']} at step {step}; the last good checkpoint is kept. "
            "Lower optim.lr, check the data, or use precision.compute=float32"
        )
    window.append(metrics["loss"])
    if step % config.log.every and not force:
        return
    row = {
        "loss": sum(window) / len(window),
        "lr": metrics["lr"],
        "grad_norm": metrics["grad_norm"],
        "tokens_per_s": tokens_per_step / step_time if step_time > 0 else 0.0,
        "step_time_s": step_time,
        "data_wait_frac": min(wait_s / step_time, 1.0) if step_time > 0 else 0.0,
    }
    row.update({k: v for k, v in metrics.items() if k == "ckpt_block_s"})
    window.clear()
    writer.write(step, row)
    result.last_metrics = row
