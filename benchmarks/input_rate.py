"""Measure the configured input pipeline alone, beside the raw read rate of the same files:

    python benchmarks/input_rate.py --config configs/demo.yaml [section.key=value ...] [--batches N]

Prints first-batch latency, batches/s and tokens/s of the Grain chain (this host's share of the
global batch), and records/s and bytes/s of batched raw ArrayRecord reads with no decoding.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator

if not __package__:  # run as `python benchmarks/input_rate.py`, not imported from benchmarks/
    import _repo_root  # noqa: F401  (before any project import: see its docstring)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grain  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from benchmarks._cli import positive_int, repo_file  # noqa: E402
from input_pipeline.corpora import resolve_dataset  # noqa: E402
from input_pipeline.dataset_info import DatasetInfo, load_dataset_info  # noqa: E402
from input_pipeline.errors import DataError  # noqa: E402
from input_pipeline.pipeline import make_batch_iterator  # noqa: E402
from trainer.data import train_reading  # noqa: E402

FORMAT_NAMES = {"arrayrecord": "ArrayRecord", "tfrecord": "TFRecord"}


def configured_batches(info: DatasetInfo, data, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """The chain `data` (a config's `data` section) configures, over the train split."""
    return make_batch_iterator(
        info,
        "train",
        seq_len=data.seq_len,
        batch_size=data.global_batch_size,
        packing=data.packing,
        reading=train_reading(data, seed),
        max_docs_per_row=data.resolved_max_docs_per_row,
        concat_offset=data.concat_offset,
    )


def iterator_rate(
    open_batches: Callable[[], Iterator[dict[str, np.ndarray]]], batches: int
) -> dict[str, float]:
    """First-batch latency (opening included), then batches/s and tokens/s (tokens with
    weight, i.e. real next-token pairs) over `batches` more."""
    start = time.perf_counter()
    iterator = open_batches()
    next(iterator)
    first_s = time.perf_counter() - start
    tokens, start = 0, time.perf_counter()
    for _ in range(batches):
        tokens += int(np.count_nonzero(next(iterator)["weights"]))
    elapsed = time.perf_counter() - start
    return {
        "first_batch_s": first_s,
        "batches_per_s": batches / elapsed,
        "tokens_per_s": tokens / elapsed,
    }


def pipeline_rate(info: DatasetInfo, data, seed: int, batches: int) -> dict[str, float]:
    return iterator_rate(lambda: configured_batches(info, data, seed), batches)


def raw_read_rate(info: DatasetInfo, records: int, chunk: int = 256) -> dict[str, float]:
    """Batched `__getitems__` over shuffled indices: the ceiling for reading these files (for
    TFRecord, a sequential batched read of the serialized records)."""
    if info.format == "tfrecord":
        return _raw_tfrecord_rate(info, records, chunk)
    source = grain.sources.ArrayRecordDataSource([str(p) for p in info.shard_paths("train")])
    order = np.random.default_rng(0).permutation(len(source))[:records]
    read, start = 0, time.perf_counter()
    for i in range(0, len(order), chunk):
        read += sum(len(r) for r in source.__getitems__(order[i : i + chunk].tolist()))
    elapsed = time.perf_counter() - start
    itemsize = np.dtype(info.token_dtype).itemsize
    return {"records_per_s": len(order) / elapsed, "tokens_per_s": read / itemsize / elapsed}


def _raw_tfrecord_rate(info: DatasetInfo, records: int, chunk: int) -> dict[str, float]:
    from input_pipeline.tfrecords import tensorflow

    tf = tensorflow()
    files = [str(p) for p in info.shard_paths("train")]
    dataset = tf.data.TFRecordDataset(files).take(records).batch(chunk)
    count, start = 0, time.perf_counter()
    for serialized in dataset.as_numpy_iterator():
        count += len(serialized)
    elapsed = time.perf_counter() - start
    tokens_per_record = info.num_tokens("train") / info.num_records("train")  # varints: no size
    return {"records_per_s": count / elapsed, "tokens_per_s": count * tokens_per_record / elapsed}


def main(argv: list[str] | None = None) -> int:
    from trainer.config import load_config
    from trainer.errors import ConfigError

    parser = argparse.ArgumentParser(
        prog="python benchmarks/input_rate.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=repo_file("configs/demo.yaml"))
    parser.add_argument("--batches", type=positive_int, default=50)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    flags.FLAGS.mark_as_parsed()  # Grain worker processes (data.workers > 0) read absl flags
    try:
        config = load_config(args.config, args.overrides)
        info = load_dataset_info(resolve_dataset(config.data.path, config.data.cache_dir))
        pipe = pipeline_rate(info, config.data, config.run.seed, args.batches)
        raw = raw_read_rate(info, records=20000)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    d = config.data
    print(
        f"pipeline ({d.packing} packing, {d.global_batch_size}x{d.seq_len}, "
        f"{d.read_threads} threads, {d.workers} workers): "
        f"first batch {pipe['first_batch_s']:.2f}s, "
        f"{pipe['batches_per_s']:.1f} batches/s, {pipe['tokens_per_s']:,.0f} tokens/s"
    )
    print(
        f"raw {FORMAT_NAMES[info.format]} reads: {raw['records_per_s']:,.0f} records/s, "
        f"{raw['tokens_per_s']:,.0f} tokens/s "
        f"(pipeline at {pipe['tokens_per_s'] / raw['tokens_per_s']:.2f}x of raw)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
