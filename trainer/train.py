"""The training run: a handful of named setup calls (model, mesh, program, data, checkpoint
manager, writers), then the loop (`trainer.loop`)."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import Config
from trainer.data import (
    DataSources,
    check_config_batch_layout,
    dataset_sources,
    stream_count,
    user_sources,
)
from trainer.errors import ConfigError, TrainingError
from trainer.hf import hf_folder
from trainer.loop import Loop, RunResult
from trainer.models import build_model
from trainer.models.attention import CheckedBatches, run_attention_note
from trainer.observe.flops import device_peak_tflops, flops_per_token
from trainer.observe.goodput import Goodput, format_summary, write_summary
from trainer.observe.metrics import MetricsWriter
from trainer.parallel import sharding
from trainer.parallel.pipeline import PipelineSpec
from trainer.parallel.program import TrainProgram, build_program
from trainer.parallel.state import TrainState
from trainer.samples import make_sampler
from trainer.step import LossFn, next_token_loss

# ----------------------------------------------------------------------------- setup


def model_builder(config: Config, dataset_vocab: int):
    """`rngs -> nnx.Module` for the configured model, with the vocabulary checked."""
    vocab_size = config.model.vocab_size or dataset_vocab
    if not vocab_size:
        raise ConfigError("model.vocab_size is unset and the data has no vocabulary; set it")
    if vocab_size < dataset_vocab:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the dataset's vocabulary "
            f"({dataset_vocab}); raise model.vocab_size or leave it unset"
        )
    return builder_for_vocab(config, vocab_size)


def user_model_builder(model):
    """A caller's model: a factory `rngs -> nnx.Module`, or a built module whose current values
    become the initial state (placed on the mesh by the same sharded init)."""
    if isinstance(model, nnx.Module):
        graphdef, values = nnx.split(model)
        return lambda rngs: nnx.merge(graphdef, values)
    if callable(model):
        return lambda rngs: model(rngs)
    raise ConfigError(f"model={model!r} is neither an nnx.Module nor a factory rngs -> Module")


def builder_for_vocab(config: Config, vocab_size: int | None = None):
    return functools.partial(
        build_model,
        config.model,
        vocab_size=vocab_size or config.model.vocab_size,
        compute_dtype=config.precision.compute,
        param_dtype=config.precision.params,
        pipeline=pipeline_spec(config),
        max_docs_per_row=config.data.resolved_max_docs_per_row,
    )


def pipeline_spec(config: Config) -> PipelineSpec | None:
    """The pipeline `mesh.stage` and `pipeline.*` ask for; None without stages."""
    if config.mesh.stage == 1:
        return None
    return PipelineSpec(config.mesh.stage, config.pipeline_microbatches)


def run_metadata(config: Config, sources: DataSources, params: Any) -> dict[str, Any]:
    return {
        "config": config.to_dict(),
        "dataset_fingerprint": sources.fingerprint,
        "vocab_size": config.model.vocab_size or sources.vocab_size,
        "param_shapes": param_shapes(params),
    }


# ----------------------------------------------------------------------------- run


def run(
    config: Config,
    *,
    model: Any = None,
    loss_fn: LossFn = next_token_loss,
    data: Any = None,
    eval_data: Any = None,
) -> RunResult:
    """Train to `run.steps`, resuming from the workdir's latest checkpoint.

    Without arguments, the configured model trains on the configured dataset. A caller may bring
    `model` (an `nnx.Module`, or a factory `rngs -> nnx.Module`), `loss_fn` (`(model, batch) ->
    (loss, aux)`), `data` (a Grain dataset or any iterable of numpy batch dicts, this host's rows)
    and `eval_data` (re-iterable, or a callable returning a fresh iterable).
    """
    with Goodput() as goodput:  # counts this session's compiles while open
        return _run(config, goodput, model, loss_fn, data, eval_data)


def _run(
    config: Config, goodput: Goodput, model: Any, loss_fn: LossFn, data: Any, eval_data: Any
) -> RunResult:
    workdir = Path(config.run.workdir)
    primary = jax.process_index() == 0
    mesh = sharding.make_mesh(config.mesh)
    ours = data is None  # a caller's batches: only their split into microbatches is ours
    pipeline = pipeline_spec(config)
    if pipeline is not None and model is not None:
        raise ConfigError(
            f"mesh.stage={pipeline.stages} splits the built-in transformer's layer stack; a "
            "model passed to trainer.run is not split into stages: use mesh.stage=1"
        )
    check_config_batch_layout(
        config,
        batch_shards=mesh.shape["data"] * mesh.shape["fsdp"] if ours else 1,
        streams=stream_count(config) if ours else 1,
    )
    sources = dataset_sources(config) if ours else user_sources(data, eval_data)
    if model is None and not ours:  # the built-in model's packed kernel takes a bounded count
        bound = config.data.resolved_max_docs_per_row
        sources = replace(sources, train=CheckedBatches(sources.train, bound))
    if model is None:
        build = model_builder(config, sources.vocab_size or config.model.vocab_size or 0)
    else:
        build = user_model_builder(model)
    program = build_program(config, mesh, build, loss_fn)
    if primary:
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / "config.yaml").write_text(config.to_yaml())
        except OSError as err:
            raise TrainingError(
                f"cannot write run.workdir={workdir}: {err.strerror}; choose a writable folder"
            ) from None
    checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
    train_iter = sources.train
    with goodput.timing("checkpoint" if checkpointer.latest_step() is not None else "other"):
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
            f"{run_attention_note(config, builtin=model is None)}"
        )
    else:
        staged = (
            ""
            if pipeline is None
            else f"; pipeline {pipeline.stages} stages x {pipeline.microbatches} microbatches "
            f"(bubble {pipeline.bubble:.1%} of each step)"
        )
        writer.message(
            f"{config.run.name}: model {program.num_params / 1e6:.2f}M parameters; "
            f"mesh {dict(mesh.shape)}{staged}; data {sources.description}"
            f"{run_attention_note(config, builtin=model is None)}"
        )
    if sources.make_eval is None:
        writer.message(
            f"data {sources.description} has no eval split; training without evals (prepare it "
            "with --eval-fraction or --eval-input to get eval_loss)"
            if ours
            else "no eval_data given; training without evals"
        )
    vocab_size = config.model.vocab_size or sources.vocab_size
    builtin = model is None and config.model.kind == "transformer"
    loop = Loop(
        config,
        sources,
        program,
        checkpointer,
        writer,
        run_metadata(config, sources, state.params),
        flops_per_token=flops_per_token(config, program.num_params, vocab_size or 0, builtin),
        peak_tflops=device_peak_tflops(config.log.peak_tflops),
        goodput=goodput,
        sampler=make_sampler(config, build, mesh, writer, builtin and ours),
    )
    try:
        with jax.set_mesh(mesh):
            result = loop.train(state, start_step, train_iter)
        with goodput.timing("checkpoint"):
            checkpointer.wait()  # saves still being written hold up the end of the run
        if primary and result.step > start_step:  # else the last session's summary stays
            summary = loop.summary(start_step, result)
            writer.message(format_summary(summary))
            if problem := write_summary(workdir, summary):
                writer.message(problem)
        return result
    finally:
        checkpointer.close()
        writer.close()


def restore_or_init(config: Config, checkpointer: Checkpointer, program: TrainProgram, train_iter):
    """Newest checkpoint that restores (state + data position), or a fresh sharded init.
    Damaged checkpoints are moved aside; a run never starts afresh over them."""
    if checkpointer.latest_step() is None and not checkpointer.damaged():
        if config.checkpoint.init_from:
            return init_from(config.checkpoint.init_from, program), 0
        return program.init(), 0
    target = program.abstract_state()
    step, (state, data_state) = checkpointer.restore_newest(
        lambda step: checkpointer.restore(step, target)
    )
    if data_state is not None:
        train_iter.set_state(data_state)
    return state, step


def init_from(path: str, program: TrainProgram) -> TrainState:
    """A fresh state whose parameters come from another run's latest checkpoint (fine-tuning):
    optimizer state, step and data position start anew. `hf:PATH`: a Hugging Face folder."""
    target = program.abstract_state().params
    if (folder := hf_folder(path)) is not None:
        from trainer.hf.weights import load_hf_params

        with jax.set_mesh(program.mesh):
            return program.init().replace(params=load_hf_params(folder, target))
    source, _ = Checkpointer.open_existing(path)
    try:
        _, params = source.restore_newest(
            lambda step: source.restore_params(step, target),
            advice="repair them, or point checkpoint.init_from at another run",
        )
    finally:
        source.close()
    return program.init().replace(params=params)
