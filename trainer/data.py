"""Where a run's batches come from: the configured prepared datasets (`data.mixture`, or
`data.path` as a mixture of one), or whatever a library user hands to `trainer.run(config,
data=...)` — a Grain dataset or any iterable of batch dicts of numpy arrays with a leading batch
axis (this host's rows).

Each data stream (`input_pipeline.streams`) draws its rows from one packed iterator per source
(`input_pipeline.mixture`), so every source keeps the stream contract: the same batches on any
process count, and a checkpointed position that resumes exactly. Each source of a mixture is
also evaluated on its own held-out split.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np

from input_pipeline.corpora import default_cache_dir, resolve_dataset
from input_pipeline.dataset_info import (
    DatasetInfo,
    alone,
    load_dataset_info,
    verify_datasets,
)
from input_pipeline.errors import DataError
from input_pipeline.mixture import mixed, rows_per_read, tokens_by_source
from input_pipeline.packing import blank_batch
from input_pipeline.pipeline import make_batch_iterator, memory_source
from input_pipeline.reading import Reading
from input_pipeline.records import MemorySource, SkippedCount, available_memory, memory_needed
from input_pipeline.streams import StreamBatches
from input_pipeline.tokenizers import Tokenizer, get_tokenizer
from input_pipeline.verified import VerifiedShards, record_file
from trainer.caller_batches import BatchDicts, check_not_one_batch, checked_eval
from trainer.config import DataConfig, MixtureSource
from trainer.errors import ConfigError
from trainer.parallel.agreement import data_not_opened, gather_rows

# This process's place among the processes that feed distinct rows of a batch, and their count
# (`input_pipeline.device.row_feeders`, computed once per run from its mesh).
Feeders = tuple[int, int]


@dataclass
class DataSources:
    """The train iterator (its `get_state`/`set_state`, when present, is checkpointed), a way to
    get a fresh pass over the eval data, and what checkpoints record about the data."""

    train: Iterator[dict[str, Any]]
    make_eval: Callable[[], Iterable[dict[str, Any]]] | None
    description: str
    fingerprint: str
    vocab_size: int | None = None
    skipped_records: Callable[[], int] | None = None  # records dropped so far (SkippedCount)
    # a mixture: each source's weight and eval data (`eval_loss_<name>`), and its tokens so far
    # from the data position of a step (`tokens_<name>`)
    make_evals: dict[str, tuple[float, Callable[[], Iterable[dict[str, Any]]]]] | None = None
    source_tokens: Callable[[Any], dict[str, float]] | None = None
    feeders: int = 1  # processes feeding distinct rows: a batch's global row count is theirs
    load_tokenizer: Callable[[], Tokenizer] | None = None  # the prepared data's, for samples
    without_evals: str = "no eval_data given; training without evals"  # said when make_eval is None
    unchecked: tuple[DatasetInfo, ...] = ()  # datasets left to `verify_shards`


@dataclass(frozen=True)
class Source:
    """One prepared dataset of the run: its name in metrics, its weight, and its splits held in
    RAM (`data.cache=memory`)."""

    name: str
    weight: float
    info: DatasetInfo
    in_memory: dict[str, MemorySource]


def stream_count(data: DataConfig, feeders: Feeders) -> int:
    """`data.streams`, or one stream per row feeder (kept on resume, see `StreamBatches`)."""
    return data.streams or feeders[1]


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


def skip_log_path(workdir: str | Path) -> Path:
    """Where this host's pipeline lists the records `data.skip_corrupt` dropped."""
    return Path(workdir) / f"skipped_records.{jax.process_index()}.jsonl"


def dataset_sources(
    data: DataConfig,
    *,
    seed: int,
    skip_log: Path | None = None,
    feeders: Feeders = (0, 1),
    verify: bool = True,
) -> DataSources:
    """The configured datasets' train batches (this process's rows as feeder `feeders`), their
    eval data, and what checkpoints record about them; unreadable records are listed in
    `skip_log`. `verify=False` leaves the shards' check to `verify_shards`."""
    reading = train_reading(data, seed, skip_log)
    sources = load_sources(data, reading, verify)
    train = stream_batches(data, sources, "train", reading, feeders)

    def eval_of(source: Source) -> Callable[[], StreamBatches]:
        # as many streams as training uses, which a resumed run may take from its checkpoint
        return lambda: stream_batches(data, [source], "eval", reading, feeders, train.streams)

    evals = {s.name: (s.weight, eval_of(s)) for s in sources if "eval" in s.info.raw["splits"]}
    mixture = len(sources) > 1  # one source: no per-source metrics
    unevaluated = [s.name for s in sources if s.name not in evals]
    if mixture and evals and unevaluated:
        print(
            f"data.mixture sources {', '.join(unevaluated)} have no eval split; eval_loss is "
            f"the weighted mean of {', '.join(evals)} only (prepare them with --eval-fraction "
            "or --eval-input to include them)",
            file=sys.stderr,
        )
    description, fingerprint = identity(sources)
    first = sources[0].info  # every source has its tokenizer (`check_same_tokenizer`)
    return DataSources(
        train=train,
        make_eval=next((make for _, make in evals.values()), None),  # none: no evals
        description=description,
        fingerprint=fingerprint,
        vocab_size=first.vocab_size,
        skipped_records=None if skip_log is None else SkippedCount(skip_log),
        make_evals=evals if mixture else None,
        source_tokens=tokens_by_source if mixture else None,
        feeders=feeders[1],
        load_tokenizer=functools.partial(get_tokenizer, first.tokenizer, first.path),
        without_evals=f"data {description} has no eval split; training without evals (prepare "
        "it with --eval-fraction or --eval-input to get eval_loss)",
        unchecked=() if verify else tuple(s.info for s in sources),
    )


def train_reading(data: DataConfig, seed: int, skip_log: Path | None = None) -> Reading:
    """How the train pass of `data` reads its records (an eval pass: see `stream_batches`)."""
    return Reading(
        shuffle=data.shuffle,
        seed=seed,
        read_threads=data.read_threads,
        workers=data.workers,
        skip_corrupt=data.skip_corrupt,
        skip_log=skip_log,
        reader=data.reader,
    )


def stream_batches(
    data: DataConfig,
    sources: list[Source],
    split: str,
    reading: Reading,
    feeders: Feeders,
    streams: int | None = None,
) -> StreamBatches:
    """This process's rows of every global batch of `split`, each stream mixing its rows from
    `sources` by weight, read as `streams` streams (default `stream_count`); `reading` is the
    train pass's, an eval pass reads each record once, in order."""
    training = split == "train"
    if not training:
        reading = replace(reading, shuffle=False, num_epochs=1, workers=0)
    weights = {s.name: s.weight for s in sources}

    def open_stream(index: int, count: int):
        # `count` may come from a checkpoint, so it is checked here and not only at setup
        check_batch_layout(data.global_batch_size, 1, streams=count)
        rows = data.global_batch_size // count
        iterators = {
            s.name: make_batch_iterator(
                s.info,
                split,
                seq_len=data.seq_len,
                batch_size=rows_per_read(s.weight / sum(weights.values()), rows),
                packing=data.packing,
                reading=replace(reading, process_index=index, process_count=count),
                source=s.in_memory.get(split),
                max_docs_per_row=data.resolved_max_docs_per_row,
                concat_offset=data.concat_offset if training else "none",
            )
            for s in sources
        }
        return mixed(iterators, weights, rows)

    return StreamBatches(
        open_stream,
        streams or stream_count(data, feeders),
        *feeders,
        pinned=data.streams is not None,
        pad_exhausted=not training,
        blank=lambda count: blank_batch(data.global_batch_size // count, data.seq_len),
    )


def identity(sources: list[Source]) -> tuple[str, str]:
    """What run lines and checkpoints call the data: a dataset its folder and content hash, a
    mixture its weights and a hash of its sources."""
    if len(sources) == 1:
        return str(sources[0].info.path), sources[0].info.fingerprint
    spec = [(s.name, s.weight, s.info.fingerprint) for s in sources]
    return (
        "mixture " + ", ".join(f"{s.name}={s.weight:g}" for s in sources),
        hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16],
    )


def load_sources(data: DataConfig, reading: Reading, verify: bool = True) -> list[Source]:
    """`data.mixture`'s datasets, or `data.path` alone, loaded and checked: distinct names, one
    tokenizer, their shards' checksums (unless not `verify`), and with `data.cache=memory` every
    split in RAM."""
    entries = data.mixture or [MixtureSource(path=data.path, weight=1.0)]
    names = [e.name or Path(e.path).name for e in entries]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(
                f"data.mixture has two sources named {name!r}; give each a distinct `name`"
            )
    keys = (
        [f"data.mixture[{i}].path" for i in range(len(entries))] if data.mixture else ["data.path"]
    )
    infos = {
        name: load_dataset(data, e.path, key, verify=False)
        for name, e, key in zip(names, entries, keys, strict=True)
    }
    if verify:  # all together: one line says what is read, and the shards hash in parallel
        verify_shards(data, list(infos.values()))
    check_same_tokenizer(infos)
    caches = memory_caches(data, infos, reading)
    return [
        Source(name, e.weight, infos[name], caches[name])
        for name, e in zip(names, entries, strict=True)
    ]


def load_dataset(
    data: DataConfig, path: str | None = None, key: str = "data.path", verify: bool = True
) -> DatasetInfo:
    """The prepared dataset folder `path` (default `data.path`; built-in corpora are prepared on
    first use), named by config key `key`, its shards checked against their recorded checksums
    unless `data.verify_checksums` is off (or `verify` is: the caller checks them)."""
    info = load_dataset_info(resolve_dataset(path or data.path, data.cache_dir, key))
    if data.verify_checksums and not verify:
        info.checksums()  # a missing shard fails here, as the data opens, not in the later check
    elif verify:
        verify_shards(data, [info])
    return info


def verify_shards(
    data: DataConfig, datasets: Sequence[DatasetInfo], setting: tuple[str, str] | None = None
) -> None:
    """The check of the shards of `datasets` against their recorded sha256 (`verify_datasets`),
    unless `data.verify_checksums` is off, against this process's record of those checked
    before. A shard that fails stops the run (`data.skip_corrupt`: a warning). Without
    `setting`, this process checks alone (`load_dataset`). With it (the config key and value of
    the data, to name it in a line), all the processes of the run check together, so that each
    shard on shared storage is read once among them: call it then on every process once
    `check_same_data` has passed (their lists of shards are the same); one process whose own
    shard fails stops the others with a line naming it."""
    if not data.verify_checksums:
        return
    me, gather = (0, alone) if setting is None else (jax.process_index(), _gather_int64)
    try:
        failed = verify_datasets(datasets, verified_shards(data), me=me, gather=gather)
    except DataError as err:
        if not data.skip_corrupt:
            raise
        print(f"warning: {err}; reading on since data.skip_corrupt=true", file=sys.stderr)
        return
    if failed is not None and setting is not None and not data.skip_corrupt:
        raise ConfigError(data_not_opened(failed, *setting))


def _gather_int64(mine: np.ndarray) -> np.ndarray:
    """Every process's `mine` (int64), stacked: sent as bytes, since JAX holds only 32-bit
    integers unless told otherwise."""
    everyone, _ = gather_rows(np.ascontiguousarray(mine, np.int64).view(np.uint8))
    return np.ascontiguousarray(everyone).view(np.int64)


def verified_shards(data: DataConfig) -> VerifiedShards:
    """This process's record of the shards it has checked, in the cache folder of built-in
    corpora (which hosts may share)."""
    cache_dir = Path(data.cache_dir or default_cache_dir())
    return VerifiedShards(record_file(cache_dir, jax.process_index()))


def check_same_tokenizer(infos: dict[str, DatasetInfo]) -> None:
    """Sources of one model must agree on what a token id means."""
    (first, first_info), *rest = infos.items()
    for name, info in rest:
        if info.tokenizer != first_info.tokenizer or info.token_dtype != first_info.token_dtype:
            raise ConfigError(
                f"data.mixture sources {first!r} ({_describe(first_info)}) and {name!r} "
                f"({_describe(info)}) use different tokenizers; prepare every source with the "
                "same --tokenizer"
            )


def _describe(info: DatasetInfo) -> str:
    tok = info.tokenizer
    digest = f" {tok['sha256'][:8]}" if "sha256" in tok else ""
    return f"{tok.get('kind')} vocab {tok.get('vocab_size', info.vocab_size)}{digest}"


def memory_caches(
    data: DataConfig, infos: dict[str, DatasetInfo], reading: Reading
) -> dict[str, dict[str, MemorySource]]:
    """With `data.cache=memory`, every split of every dataset read into RAM (checksums were
    verified by `load_sources`, or are next, by `verify_shards`); a one-line error first
    when they do not fit in the memory this host has available."""
    if data.cache != "memory":
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
    return {
        name: {split: memory_source(info, split, reading) for split in info.raw["splits"]}
        for name, info in infos.items()
    }


def user_sources(data: Any, eval_data: Any = None, *, feeders: Feeders = (0, 1)) -> DataSources:
    """Batches a caller brings (this process's rows as feeder `feeders`). `eval_data` must be
    re-iterable (a list, a Grain dataset) or a zero-argument callable returning a fresh
    iterable, since every eval starts from its top."""
    fixed = eval_data is None or callable(eval_data)
    if isinstance(eval_data, Iterator):  # read by the first eval, then empty
        raise ConfigError(
            f"eval_data is a one-shot {type(eval_data).__name__}, and every eval reads it from "
            "its top; pass a list, a Grain dataset, or a function returning a fresh iterator"
        )
    for name, value in (("data", data), ("eval_data", None if fixed else eval_data)):
        if value is not None and not isinstance(value, Iterable):
            raise ConfigError(
                f"{name}={value!r:.40} is not iterable; pass a Grain dataset or an iterable of "
                "batch dicts"
            )
    for name, value in (("data", data), ("eval_data", eval_data)):
        check_not_one_batch(name, value)
    make_eval = (
        None if eval_data is None else checked_eval(eval_data if fixed else lambda: eval_data)
    )
    return DataSources(
        train=BatchDicts(data, "data"),
        make_eval=make_eval,
        description=type(data).__name__,
        fingerprint=f"user:{type(data).__name__}",
        feeders=feeders[1],
    )
