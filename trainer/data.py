"""Where a run's batches come from: the configured prepared dataset (`data.*`), or whatever a
library user hands to `trainer.run(config, data=...)` — a Grain dataset or any iterable of batch
dicts of numpy arrays with a leading batch axis (this host's rows)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax

from input_pipeline.corpora import resolve_dataset
from input_pipeline.dataset_info import DatasetInfo, load_dataset_info
from input_pipeline.device import row_feeders
from input_pipeline.errors import DataError
from input_pipeline.pipeline import make_batch_iterator, memory_source
from input_pipeline.reading import Reading
from input_pipeline.records import MemorySource, available_memory, count_skipped, memory_needed
from input_pipeline.streams import StreamBatches
from trainer.config import Config
from trainer.errors import ConfigError
from trainer.parallel.sharding import batch_sharding, make_mesh


@dataclass
class DataSources:
    """The train iterator (its `get_state`/`set_state`, when present, is checkpointed), a way to
    get a fresh pass over the eval data, and what checkpoints record about the data."""

    train: Iterator[dict[str, Any]]
    make_eval: Callable[[], Iterable[dict[str, Any]]] | None
    description: str
    fingerprint: str
    vocab_size: int | None = None
    skipped_records: Callable[[], int] | None = None  # unreadable records dropped so far
    # a mixture: each source's weight and eval data (`eval_loss_<name>`), and its tokens so far
    # from the data position of a step (`tokens_<name>`)
    make_evals: dict[str, tuple[float, Callable[[], Iterable[dict[str, Any]]]]] | None = None
    source_tokens: Callable[[Any], dict[str, float]] | None = None


def row_feeder(config: Config) -> tuple[int, int]:
    """This process's place among the processes that feed distinct rows of the configured mesh's
    batches, and their count: the process count, unless pipeline stages span hosts (then the
    hosts of one row block feed the same rows; `input_pipeline.device.row_feeders`)."""
    return row_feeders(batch_sharding(make_mesh(config.mesh)))


def stream_count(config: Config) -> int:
    """`data.streams`, or one stream per row feeder (kept on resume, see `StreamBatches`)."""
    return config.data.streams or row_feeder(config)[1]


def check_batch_layout(
    global_batch_size: int,
    accum_steps: int,
    batch_shards: int = 1,
    streams: int = 1,
    microbatches: int = 1,
) -> None:
    """Every cut of the global batch must come out whole: into `accum_steps` microbatches, each
    into `microbatches` pipeline microbatches, each split over the mesh's `batch_shards`
    (data*fsdp) devices, and into `streams` input streams; one line naming what does not divide
    and the nearest batch size that does."""
    problems = []
    cut = accum_steps * microbatches
    what = f"optim.accum_steps={accum_steps}" + (
        f" x pipeline.microbatches={microbatches}" if microbatches > 1 else ""
    )
    if global_batch_size % cut:
        problems.append(f"is not divisible by {what}")
    elif (global_batch_size // cut) % batch_shards:
        problems.append(
            f"/ {what} = {global_batch_size // cut} rows do not "
            f"split over mesh data*fsdp={batch_shards}"
        )
    if global_batch_size % streams:
        problems.append(
            f"is not divisible by {streams} data streams (data.streams, or the process count)"
        )
    if problems:
        rows = cut * batch_shards
        multiple = math.lcm(rows, streams)
        nearest = -(-global_batch_size // multiple) * multiple
        pipelined = " x pipeline.microbatches" if microbatches > 1 else ""
        why = [f"optim.accum_steps{pipelined} x mesh data*fsdp = {rows}"] if rows > 1 else []
        why += [f"{streams} data streams"] if streams > 1 else []
        raise ConfigError(
            f"data.global_batch_size={global_batch_size} "
            + " and ".join(problems)
            + f"; use a multiple of {multiple} ({' and '.join(why)}), "
            f"e.g. data.global_batch_size={nearest}"
        )


def check_config_batch_layout(config: Config, batch_shards: int, streams: int = 1) -> None:
    """`check_batch_layout` for `config`'s global batch, accumulation and pipeline microbatches
    (the run and `trainer.plan` check the same cuts)."""
    check_batch_layout(
        config.data.global_batch_size,
        config.optim.accum_steps,
        batch_shards,
        streams,
        microbatches=config.pipeline_microbatches if config.mesh.stage > 1 else 1,
    )


def load_dataset(config: Config, path: str | None = None) -> DatasetInfo:
    """The prepared dataset folder `path` (default `data.path`; built-in corpora are prepared on
    first use), its shards checked against their recorded checksums unless
    `data.verify_checksums` is off."""
    info = load_dataset_info(resolve_dataset(path or config.data.path, config.data.cache_dir))
    if config.data.verify_checksums:
        try:
            info.verify_checksums()
        except DataError as err:
            if not config.data.skip_corrupt:
                raise
            print(f"warning: {err}; reading on since data.skip_corrupt=true", file=sys.stderr)
    return info


def lm_batches(
    config: Config,
    info: DatasetInfo,
    split: str,
    streams: int | None = None,
    cache: MemorySource | None = None,
) -> StreamBatches:
    """This host's rows of every packed global batch of a prepared dataset split, read as
    `streams` streams (default `stream_count(config)`), from `cache` when it is in RAM."""
    training = split == "train"
    reading = reading_for(config, training)

    def open_stream(index: int, count: int):
        # `count` may come from a checkpoint, so it is checked here and not only at setup
        check_batch_layout(config.data.global_batch_size, 1, streams=count)
        return make_batch_iterator(
            info,
            split,
            seq_len=config.data.seq_len,
            batch_size=config.data.global_batch_size // count,
            packing=config.data.packing,
            reading=replace(reading, process_index=index, process_count=count),
            source=cache,
            max_docs_per_row=config.data.resolved_max_docs_per_row,
            concat_offset=config.data.concat_offset if training else "none",
        )

    return StreamBatches(
        open_stream,
        streams or stream_count(config),
        *row_feeder(config),
        pinned=config.data.streams is not None,
        pad_exhausted=not training,
    )


def reading_for(config: Config, training: bool) -> Reading:
    """How the train (or an eval) pass of a configured dataset reads its records."""
    return Reading(
        shuffle=config.data.shuffle and training,
        seed=config.run.seed,
        num_epochs=None if training else 1,
        read_threads=config.data.read_threads,
        workers=config.data.workers if training else 0,
        skip_corrupt=config.data.skip_corrupt,
        skip_log=skip_log_path(config),
        reader=config.data.reader,
    )


def skip_log_path(config: Config) -> Path:
    """Where this host's pipeline lists the records `data.skip_corrupt` dropped."""
    return Path(config.run.workdir) / f"skipped_records.{jax.process_index()}.jsonl"


def dataset_sources(config: Config) -> DataSources:
    if config.data.mixture:
        from trainer.mixture import mixture_sources

        return mixture_sources(config)
    info = load_dataset(config)
    caches = memory_caches(config, {"data.path": info})["data.path"]
    train = lm_batches(config, info, "train", cache=caches.get("train"))

    def make_eval() -> StreamBatches:
        # as many streams as training uses, which a resumed run may take from its checkpoint
        return lm_batches(config, info, "eval", train.streams, caches.get("eval"))

    return DataSources(
        train=train,
        make_eval=make_eval if "eval" in info.raw["splits"] else None,  # none: no evals
        description=str(info.path),
        fingerprint=info.fingerprint,
        vocab_size=info.vocab_size,
        skipped_records=lambda: count_skipped(skip_log_path(config)),
    )


def memory_caches(
    config: Config, infos: dict[str, DatasetInfo]
) -> dict[str, dict[str, MemorySource]]:
    """With `data.cache=memory`, every split of every dataset read into RAM (checksums were
    verified by `load_dataset`); a one-line error first when they do not fit in the memory this
    host has available."""
    if config.data.cache != "memory":
        return {name: {} for name in infos}
    sizes = [
        memory_needed(info.num_records(split), info.num_tokens(split), info.token_dtype)
        for info in infos.values()
        for split in info.raw["splits"]
    ]
    needed = sum(sizes) + max(sizes)  # the largest split is held twice while it is joined
    available = available_memory()
    if needed > available:
        raise DataError(
            f"data.cache=memory needs {needed / 2**30:.2f} GiB for "
            f"{', '.join(str(i.path) for i in infos.values())} but this host has "
            f"{available / 2**30:.2f} GiB available; use data.cache=none"
        )
    reading = reading_for(config, training=False)
    return {
        name: {split: memory_source(info, split, reading) for split in info.raw["splits"]}
        for name, info in infos.items()
    }


def user_sources(data: Any, eval_data: Any = None) -> DataSources:
    """Batches a caller brings. `eval_data` must be re-iterable (a list, a Grain dataset) or a
    zero-argument callable returning a fresh iterable, since every eval starts from its top."""
    fixed = eval_data is None or callable(eval_data)
    make_eval = eval_data if fixed else lambda: eval_data
    return DataSources(
        train=iter(data),
        make_eval=make_eval,
        description=type(data).__name__,
        fingerprint=f"user:{type(data).__name__}",
    )
