"""Grain worker processes (`data.workers > 0`) never start an accelerator backend.

The check is behavioural, in the worker itself: a stand-in accelerator platform is registered with
JAX there and JAX is asked for its devices, the first thing any JAX code does. JAX then starts
every registered platform unless `jax_platforms` names the ones allowed, so the stand-in's factory
runs exactly when a real GPU or TPU plugin would start its backend (and take device memory) on an
accelerator host. The worker also reports which backends existed before that call: none may have
been started by the worker's own start-up. The parent's JAX_PLATFORMS / CUDA_VISIBLE_DEVICES
(which conftest pins for the test processes) are removed first, as on a real GPU host.

A worker also ignores SIGINT: a terminal's Ctrl-C reaches the whole process group, and the
trainer, which stops the workers itself, turns it into a clean stop.
"""

import json
import os
import signal
import threading
from pathlib import Path

import numpy as np

from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.device import DeviceFeed
from input_pipeline.pipeline import make_batch_iterator, split_source
from input_pipeline.reading import Reading
from input_pipeline.records import MemorySource

PROBE_LOCK = threading.Lock()  # a worker reads on several threads: one probe per process


class ProbingSource(MemorySource):
    """A split in RAM that, on its first read in a worker process, writes what JAX there would
    start to `report`."""

    def __init__(self, source, report: Path):
        super().__init__(source)
        self.report = str(report)
        self.parent = os.getpid()

    def read_many(self, indices):
        if os.getpid() != self.parent:
            with PROBE_LOCK:
                if not os.path.exists(self.report):
                    probe_backends(self.report)
        return super().read_many(indices)


def probe_backends(report: str) -> None:
    import jax
    from jax._src import xla_bridge  # the registry of backends JAX starts (private API)

    started_before = sorted(xla_bridge._backends)
    factory_calls = []

    def stand_in_accelerator():
        factory_calls.append("started")
        raise RuntimeError("stand-in accelerator: no device")

    xla_bridge.register_backend_factory("standin_accel", stand_in_accelerator, priority=400)
    platform = jax.devices()[0].platform
    result = {
        "started_before": started_before,
        "accelerator_factory_called": bool(factory_calls),
        "started_after": sorted(xla_bridge._backends),
        "platform": platform,
        "jax_platforms": jax.config.jax_platforms,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "ignores_sigint": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
    }
    Path(report).write_text(json.dumps(result))


def test_grain_workers_start_no_accelerator_backend(corpus, tmp_path, monkeypatch):
    for name in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)  # as on a GPU host; the workers inherit this
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # workers import this module
    info = load_dataset_info(corpus)
    report = tmp_path / "worker.json"
    source = ProbingSource(split_source(info, "train", Reading()), report)
    kw = dict(seq_len=32, batch_size=4, source=source)
    batches = make_batch_iterator(info, "train", reading=Reading(workers=1, seed=3), **kw)
    try:
        first = next(batches)
    finally:
        batches.close()
    expected = next(make_batch_iterator(info, "train", reading=Reading(seed=3), **kw))
    np.testing.assert_array_equal(first["inputs"], expected["inputs"])  # the worker did read
    seen = json.loads(report.read_text())
    assert seen["started_before"] == [], seen  # the worker's start-up started no backend
    assert not seen["accelerator_factory_called"], seen
    assert seen["started_after"] == ["cpu"] and seen["platform"] == "cpu", seen
    assert seen["jax_platforms"] == "cpu" and seen["cuda_visible_devices"] == "", seen
    assert seen["ignores_sigint"], "Ctrl-C printed a KeyboardInterrupt traceback per worker"


def test_closing_the_device_feed_stops_the_data_workers(corpus):
    """The feed closes our streams' Grain readers in its own thread. Before: they were left to
    the exit's finalizers, whose stop raced Grain's own after a data error (a Grain traceback
    under the one-line error, 4 runs in 10 with four workers and no readable record)."""
    import multiprocessing

    from trainer.config import load_config
    from trainer.data import dataset_sources
    from trainer.parallel import sharding

    overrides = [f"data.path={corpus}", "data.workers=2", "data.seq_len=64"]
    config = load_config(None, [*overrides, "data.global_batch_size=8"])
    sources = dataset_sources(config.data, seed=0, skip_log=None)
    mesh = sharding.make_mesh(config.mesh)
    with DeviceFeed(sources.train, sharding.batch_sharding(mesh), prefetch=2) as feed:
        next(feed)
        assert len(multiprocessing.active_children()) == 2  # the data workers are up
    assert multiprocessing.active_children() == []
