"""The training run: a handful of named setup calls (model, mesh, program, data, checkpoint
manager, writers), then the loop (`trainer.loop`)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from input_pipeline import checkpointing as data_checkpointing
from input_pipeline.device import row_feeders
from input_pipeline.errors import DataError
from input_pipeline.workers import wait_for_dropped_batches
from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import Config, DataConfig
from trainer.data import (
    DataSources,
    check_batch_layout,
    dataset_sources,
    skip_log_path,
    stream_count,
    user_sources,
    verify_shards,
)
from trainer.errors import ConfigError, TrainingError
from trainer.hf import hf_folder
from trainer.hf.tokenizer import other_tokenizer_warning
from trainer.loop import Loop, RunResult, check_mixture_eval_step
from trainer.models import pipeline_spec, run_model
from trainer.models.attention import CheckedBatches, precision_warning
from trainer.models.spec import ModelSpec
from trainer.observe.flops import device_peak_tflops
from trainer.observe.goodput import Goodput
from trainer.observe.metrics import MetricsWriter
from trainer.optimizer import stretched_schedule_warning
from trainer.parallel import sharding
from trainer.parallel.agreement import (
    check_same_config,
    check_same_data,
    check_shared_workdir,
    data_not_opened,
    stop_every_process_on_error,
)
from trainer.parallel.pipeline import PipelineSpec
from trainer.parallel.state import TrainState
from trainer.program import TrainProgram, build_program
from trainer.samples import make_sampler
from trainer.step import LossFn, next_token_loss

INIT_FROM_ANOTHER_MODEL = (
    "point checkpoint.init_from at a run of this model, or set the model.* config it was saved with"
)

# ----------------------------------------------------------------------------- run


def run(
    config: Config,
    *,
    model: Any = None,
    loss_fn: LossFn | None = None,
    data: Any = None,
    eval_data: Any = None,
) -> RunResult:
    """Train `config` to `run.steps`, resuming from its workdir's latest checkpoint.

    model: an `nnx.Module` (its current values are the initial state) or a factory
        `rngs -> nnx.Module`; default: `model.*` of the config, which alone gets `precision.*`.
    loss_fn: `(model, batch) -> (mean loss, aux scalars)`; `aux["weight"]` = items averaged over,
        the other aux scalars are logged under their names (default: next-token cross-entropy).
    data: a Grain dataset or any iterable of numpy batch dicts, this host's rows (default: the
        prepared dataset of `data.*`); a Grain iterator's position is checkpointed.
    eval_data: re-iterable, or a callable returning a fresh iterable, for held-out loss.
    Returns a `RunResult` (final `state`, `step`, `last_metrics`, `eval_loss`).
    """
    with Goodput() as goodput:  # counts this session's compiles while open
        check_same_config(config.to_dict())  # several processes: one config, one shared workdir
        check_shared_workdir(config.run.workdir)
        mesh, pipeline = sharding.make_mesh(config.mesh), pipeline_spec(config)
        sources = open_same_data(
            config.data,
            lambda: open_data(config, mesh, pipeline, model, data, eval_data),
            prepared=data is None,
        )
        vocab_size = config.model.vocab_size or sources.vocab_size or 0
        spec, build = run_model(config, model, sources.vocab_size or 0)
        program = build_program(config, mesh, build, loss_fn or next_token_loss)
        check_mixture_eval_step(config.data, program, sources)  # before anything is written
        make_workdir(config)
        checkpointer = Checkpointer(Path(config.run.workdir) / "checkpoints", config.checkpoint)
        with goodput.timing("checkpoint" if checkpointer.latest_step() is not None else "other"):
            state, start_step, resumed_meta = restore_or_init(
                config, checkpointer, program, spec, sources.train
            )
        write_run_config(config)  # once a refused resume can no longer overwrite the run's own
        writer = open_writer(config, start_step)
        announce(
            writer, config, program, pipeline, sources, spec, checkpointer, start_step, resumed_meta
        )
        if line := eval_mode_warning(model):
            writer.message(line)
        try:
            with (
                Loop(
                    config,
                    sources,
                    program,
                    checkpointer,
                    writer,
                    run_metadata(config, sources, vocab_size, state),
                    flops_per_token=spec.flops_per_token(config, program.num_params, vocab_size),
                    peak_tflops=device_peak_tflops(config.log.peak_tflops),
                    goodput=goodput,
                    sampler=make_sampler(
                        config, spec.decoder, program.skeleton, mesh, writer, sources.load_tokenizer
                    ),
                ) as loop,
                jax.set_mesh(mesh),
            ):
                return loop.train(state, start_step)
        finally:
            wait_for_dropped_batches()  # Grain's, before the exit cuts its unlinks short


# ----------------------------------------------------------------------------- setup


def open_data(
    config: Config,
    mesh: Mesh,
    pipeline: PipelineSpec | None,
    model: Any,
    data: Any,
    eval_data: Any,
) -> DataSources:
    """The run's batches, checked to cut whole into the mesh, microbatches and streams: the
    configured dataset, or a caller's `data` (whose rows only we split into microbatches)."""
    ours = data is None
    if pipeline is not None and model is not None:
        raise ConfigError(
            f"mesh.stage={pipeline.stages} splits the built-in transformer's layer stack; a "
            "model passed to trainer.run is not split into stages: use mesh.stage=1"
        )
    feeders = row_feeders(sharding.batch_sharding(mesh))  # this process's rows, once per run
    if ours:  # a caller's batches are checked as they come (data.global_batch_size is not theirs)
        check_batch_layout(
            config.data.global_batch_size,
            config.optim.accum_steps,
            batch_shards=mesh.shape["data"] * mesh.shape["fsdp"],
            streams=stream_count(config.data, feeders),
            microbatches=pipeline.microbatches if pipeline is not None else 1,
        )
        skip_log = skip_log_path(config.run.workdir)
        return dataset_sources(
            config.data,
            seed=config.run.seed,
            skip_log=skip_log,
            feeders=feeders,
            verify=jax.process_count() == 1,  # several: together, in `open_same_data`
        )
    sources = user_sources(data, eval_data, feeders=feeders)
    if model is None:  # the built-in model's packed kernel takes a bounded count
        bound = config.data.resolved_max_docs_per_row
        sources = replace(sources, train=CheckedBatches(sources.train, bound))
    return sources


def open_same_data(
    data: DataConfig, open_sources: Callable[[], DataSources], prepared: bool
) -> DataSources:
    """`open_sources()`, checked to be the same `prepared` dataset on every process (a caller's
    batches are each host's own rows), whose shards the processes then check together; a
    process whose data does not open, or does not pass that check, stops the others too."""
    setting = data_setting(data)
    opening = f"opening its data at {setting[0]}={setting[1]}"
    with stop_every_process_on_error(opening, lambda p: ConfigError(data_not_opened(p, *setting))):
        sources = open_sources()
    check_same_data(sources.fingerprint if prepared else None, *setting)
    verify_shards(data, sources.unchecked, setting)
    return sources


def data_setting(data: DataConfig) -> tuple[str, str]:
    """The setting that names the run's prepared datasets, and its value, for a line to show."""
    if data.mixture:
        return "data.mixture", ", ".join(source.path for source in data.mixture)
    return "data.path", data.path


def make_workdir(config: Config) -> None:
    """`run.workdir`, made by the first process and checked to take files before a run is built
    in it."""
    if jax.process_index() != 0:
        return
    workdir = Path(config.run.workdir)
    with _workdir_errors(workdir):
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
            pass


def write_run_config(config: Config) -> None:
    """`<workdir>/config.yaml`, written by the first process: the resolved config of the run's
    latest session (`trainer.report` labels runs by its `run.name`)."""
    if jax.process_index() != 0:
        return
    workdir = Path(config.run.workdir)
    with _workdir_errors(workdir):
        (workdir / "config.yaml").write_text(config.to_yaml())


@contextmanager
def _workdir_errors(workdir: Path) -> Iterator[None]:
    """An OS error in `run.workdir` as one line that names it."""
    try:
        yield
    except OSError as err:
        raise TrainingError(
            f"cannot write run.workdir={workdir}: {err.strerror}; choose a writable folder"
        ) from None


def open_writer(config: Config, start_step: int) -> MetricsWriter:
    """The metrics writer of this session (the first process writes; the others only count)."""
    return MetricsWriter(
        Path(config.run.workdir),
        total_steps=config.run.steps,
        start_step=start_step,
        tensorboard=config.log.tensorboard,
        progress=config.log.progress,
        enabled=jax.process_index() == 0,
    )


def announce(
    writer: MetricsWriter,
    config: Config,
    program: TrainProgram,
    pipeline: PipelineSpec | None,
    sources: DataSources,
    spec: ModelSpec,
    checkpointer: Checkpointer,
    start_step: int,
    resumed_meta: dict[str, Any],
) -> None:
    """The startup lines: what trains on what (or where it resumes, from `resumed_meta`, the
    metadata its restore read), a precision the GPU runs slowly, and a missing eval split."""
    note = spec.startup_note(config)
    if start_step:
        where = checkpointer.directory / str(start_step)
        writer.message(f"resuming from {where} (step {start_step}){note}")
        saved = resumed_meta.get("dataset_fingerprint")
        if saved is not None and saved != sources.fingerprint:
            writer.message(
                f"warning: {where} was trained on other data ({saved}; now {sources.fingerprint})"
                " and its read position is applied to this data; to start the new data from its "
                "top, use a new run.workdir with checkpoint.init_from="
                f"{Path(config.run.workdir)}"
            )
        if line := schedule_change(config, resumed_meta, start_step):
            writer.message(line)
        if not resumes_position(sources.train):
            writer.message(
                "warning: the training data has no get_state/set_state, so it starts again from "
                f"its first batch: step {start_step + 1} trains on what step 1 did; pass an "
                "iterator with get_state/set_state (a Grain dataset's has) to resume its position"
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
            f"mesh {dict(program.mesh.shape)}{staged}; data {sources.description}{note}"
        )
        if sources.load_tokenizer is not None and hf_folder(config.checkpoint.init_from):
            tokenizer = sources.load_tokenizer()
            if line := other_tokenizer_warning(config.checkpoint.init_from, tokenizer):
                writer.message(line)
    if line := precision_warning(config.precision.compute, jax.devices()[0]):
        writer.message(line)
    if sources.make_eval is None:
        writer.message(sources.without_evals)


def schedule_change(config: Config, resumed_meta: dict[str, Any], step: int) -> str | None:
    """`stretched_schedule_warning` for a resume whose checkpoint saved a run of another
    `run.steps` without `optim.decay_steps`; None when the saved config does not say."""
    saved = resumed_meta.get("config")
    run, optim = (saved.get("run"), saved.get("optim")) if isinstance(saved, dict) else (None, None)
    if not (isinstance(run, dict) and isinstance(optim, dict)) or optim.get("decay_steps"):
        return None
    steps_then = run.get("steps")
    if not isinstance(steps_then, int) or steps_then < 1:
        return None
    return stretched_schedule_warning(config.optim, steps_then, config.run.steps, step)


def eval_mode_warning(model: Any) -> str | None:
    """The line for a built module handed over in eval mode (`model.eval()`, e.g. left from a
    check of its outputs): it would train with its dropout off and its BatchNorm statistics
    frozen, all run long, without a word. None for a factory, or a module in train mode."""
    if not isinstance(model, nnx.Module):
        return None
    frozen = [
        "/".join(map(str, path))
        for path, module in nnx.iter_graph(model)
        if isinstance(module, nnx.Module) and path and _in_eval_mode(module)
    ]
    if not frozen:
        return None
    more = f" and {len(frozen) - 3} more" if len(frozen) > 3 else ""
    return (
        f"warning: the model passed to trainer.run is in eval mode ({', '.join(frozen[:3])}{more}"
        "): it trains with dropout off and BatchNorm statistics frozen; call model.train() "
        "before trainer.run, unless that is what you mean"
    )


def _in_eval_mode(module: nnx.Module) -> bool:
    """A dropout that drops nothing, or a BatchNorm that no longer updates its statistics."""
    if getattr(module, "use_running_average", None) is True:
        return True
    return getattr(module, "deterministic", None) is True and bool(getattr(module, "rate", 0))


def run_metadata(
    config: Config, sources: DataSources, vocab_size: int, state: TrainState
) -> dict[str, Any]:
    """What every checkpoint records beside the state: how to rebuild and check the run."""
    return {
        "config": config.to_dict(),
        "dataset_fingerprint": sources.fingerprint,
        "vocab_size": vocab_size or None,  # None: a caller's model without model.vocab_size
        "param_shapes": param_shapes(state.params),
        "model_state_shapes": param_shapes(state.model_state),  # what init_from can carry
    }


def restore_or_init(
    config: Config,
    checkpointer: Checkpointer,
    program: TrainProgram,
    spec: ModelSpec,
    train_iter: Any,
) -> tuple[TrainState, int, dict[str, Any]]:
    """Newest checkpoint that restores (state + data position), or a fresh sharded init; with
    the step and the metadata saved with it (empty for a fresh start). Damaged checkpoints are
    moved aside; a run never starts afresh over them. Without either, `checkpoint.init_from`
    names the run or folder whose parameters start it."""
    if checkpointer.nothing_to_resume():
        if config.checkpoint.init_from:
            return init_from(config.checkpoint.init_from, program, spec), 0, {}
        return program.init(), 0, {}
    target = program.abstract_state()
    step, (state, data_state, meta) = checkpointer.restore_newest(
        lambda step: checkpointer.restore(step, target, config.to_dict()), newest_agreed=True
    )
    resume_position_on_every_process(
        train_iter, data_state, checkpointer.directory / str(step), meta, config
    )
    return with_this_runs_loss_scale(state, program), step, meta


def resume_position_on_every_process(
    train_iter: Any, data_state: Any, step_folder: Path, meta: dict[str, Any], config: Config
) -> None:
    """Put this process's data position back (each reads its own file), or stop every process
    when one refuses its own or fails otherwise: the others would go on to their first step's
    collectives and wait there until JAX's coordination service aborted them."""

    def elsewhere(process: int) -> DataError:
        return DataError(
            f"process {process} refused its data position in checkpoint {step_folder} (its own "
            "line says why and what to do); nothing in it was changed"
        )

    doing = f"putting back its data position from checkpoint {step_folder}"
    with stop_every_process_on_error(doing, elsewhere):  # on every process, whatever its iterator
        if resumes_position(train_iter):  # else it starts again; `announce` says so
            data_checkpointing.resume_position(
                train_iter,
                data_state,
                step_folder,
                saved_config=meta.get("config"),
                config=config.to_dict(),
            )


def with_this_runs_loss_scale(state: TrainState, program: TrainProgram) -> TrainState:
    """A resume across a change of `precision.compute` (as the float16 overflow line advises):
    a float16 checkpoint's scale is dropped for bf16/fp32, and float16 after bf16/fp32 starts
    at `precision.loss_scale_init`; float16 after float16 goes on with the saved one."""
    scaling = program.settings.scaling
    if scaling is None:
        return state.replace(loss_scale=None)
    if state.loss_scale is not None:
        return state
    with jax.set_mesh(program.mesh):
        fresh = jax.jit(scaling.init, out_shardings=program.shardings.loss_scale)()
    return state.replace(loss_scale=fresh)


def resumes_position(iterator: Any) -> bool:
    """Whether a checkpointed read position can be put back: a Grain iterator's `set_state`."""
    return callable(getattr(iterator, "set_state", None))


def init_from(path: str, program: TrainProgram, spec: ModelSpec) -> TrainState:
    """A fresh state whose parameters, and the floating-point model state the two models share
    (BatchNorm statistics), come from another run's latest checkpoint (fine-tuning): optimizer
    state, random streams, step and data position start anew. `hf:PATH`: a Hugging Face folder,
    read by the model's adapter."""
    abstract = program.abstract_state()
    target = abstract.params
    if (folder := hf_folder(path)) is not None:
        if spec.hf is None:
            raise ConfigError(
                f"checkpoint.init_from={path} reads a Hugging Face folder into the built-in "
                "transformer; this model has no Hugging Face adapter: point init_from at a run"
            )
        params = hf_params_on_every_process(path, folder, spec.hf.load_params, target, program.mesh)
        with jax.set_mesh(program.mesh):
            return program.init().replace(params=params)
    source, _ = Checkpointer.open_existing(
        path, fix="point checkpoint.init_from at the run.workdir of a past run"
    )

    def weights(step: int) -> tuple[Any, Any]:
        meta = source.read_meta(step)  # once: each read of it is an agreement of every process
        params = source.restore_params(step, target, INIT_FROM_ANOTHER_MODEL, meta)
        return params, source.restore_model_state(step, abstract.model_state, meta)

    try:
        _, (params, model_state) = source.restore_newest(
            weights, advice="repair them, or point checkpoint.init_from at another run"
        )
    finally:
        source.close()
    fresh = program.init()
    return fresh.replace(params=params, model_state=overlaid(fresh.model_state, model_state))


def overlaid(tree: Any, part: Any) -> Any:
    """`tree` (nested dicts) with the leaves `part`, a subtree of it, holds in their place."""
    if part is None:
        return tree
    if not isinstance(tree, dict):
        return part
    return {key: overlaid(value, part.get(key)) for key, value in tree.items()}


def hf_params_on_every_process(
    path: str, folder: str, load_params: Callable[[str, Any], Any], target: Any, mesh: Mesh
) -> Any:
    """`load_params(folder, target)`, or a stop on every process when one cannot read the folder
    (its host lacks it, or reads it otherwise) or fails otherwise: the others would go on to the
    first step's collectives and wait there until JAX's coordination service aborted them."""

    def elsewhere(process: int) -> ConfigError:
        return ConfigError(
            f"process {process} cannot read checkpoint.init_from={path} (its own line says "
            "why); every host must see the same folder at that path"
        )

    with stop_every_process_on_error(f"reading checkpoint.init_from={path}", elsewhere):
        try:
            with jax.set_mesh(mesh):
                return load_params(folder, target)
        except OSError as err:
            raise ConfigError(
                f"cannot read checkpoint.init_from={path} ({err.strerror}); check the storage "
                "it is on, or download the weights again"
            ) from None
