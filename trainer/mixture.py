"""`data.mixture`: several prepared datasets blended into every global batch by weight.

Each data stream (`input_pipeline.streams`) mixes its rows from one packed iterator per source
(`input_pipeline.mixture.MixedStream`), so a mixture keeps the stream contract: the same batches
on any process count, and a checkpointed position that resumes exactly. Each source is also
evaluated on its own held-out split.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from input_pipeline.dataset_info import DatasetInfo
from input_pipeline.mixture import MixedStream, rows_per_read, tokens_by_source
from input_pipeline.pipeline import make_batch_iterator
from input_pipeline.records import count_skipped
from input_pipeline.streams import StreamBatches
from trainer.config import Config
from trainer.data import (
    DataSources,
    check_batch_layout,
    lm_batches,
    load_dataset,
    memory_caches,
    reading_for,
    row_feeder,
    skip_log_path,
    stream_count,
)
from trainer.errors import ConfigError


def source_names(config: Config) -> list[str]:
    """Each source's name in metrics: its `name`, or its folder's; a one-line error on a clash."""
    names = [s.name or Path(s.path).name for s in config.data.mixture or []]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(
                f"data.mixture has two sources named {name!r}; give each a distinct `name`"
            )
    return names


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


def mixture_sources(config: Config) -> DataSources:
    """Train batches mixed by weight; per-source eval data and token counts."""
    names = source_names(config)
    mixture = config.data.mixture or []
    infos = {n: load_dataset(config, s.path) for n, s in zip(names, mixture, strict=True)}
    check_same_tokenizer(infos)
    weights = {n: s.weight for n, s in zip(names, mixture, strict=True)}
    caches = memory_caches(config, infos)
    reading = reading_for(config, training=True)

    def open_stream(index: int, count: int) -> MixedStream:
        check_batch_layout(config.data.global_batch_size, 1, streams=count)
        rows = config.data.global_batch_size // count
        total = sum(weights.values())
        iterators = {
            name: make_batch_iterator(
                info,
                "train",
                seq_len=config.data.seq_len,
                batch_size=rows_per_read(weights[name] / total, rows),
                packing=config.data.packing,
                reading=replace(reading, process_index=index, process_count=count),
                source=caches[name].get("train"),
                max_docs_per_row=config.data.resolved_max_docs_per_row,
                concat_offset=config.data.concat_offset,
            )
            for name, info in infos.items()
        }
        return MixedStream(iterators, weights, rows)

    train = StreamBatches(
        open_stream,
        stream_count(config),
        *row_feeder(config),
        pinned=config.data.streams is not None,
    )

    def eval_of(name: str):
        return lambda: lm_batches(
            config, infos[name], "eval", train.streams, caches[name].get("eval")
        )

    make_evals = {
        name: (weights[name], eval_of(name))
        for name, info in infos.items()
        if "eval" in info.raw["splits"]
    }
    spec = [(n, weights[n], infos[n].fingerprint) for n in names]
    return DataSources(
        train=train,
        make_eval=next((make for _, make in make_evals.values()), None),
        description="mixture " + ", ".join(f"{n}={weights[n]:g}" for n in names),
        fingerprint=hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16],
        vocab_size=next(iter(infos.values())).vocab_size,
        skipped_records=lambda: count_skipped(skip_log_path(config)),
        make_evals=make_evals,
        source_tokens=tokens_by_source,
    )
