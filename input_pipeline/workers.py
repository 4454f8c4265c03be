"""Start-up of Grain's worker processes (`data.workers > 0`): a worker reads and packs batches on
the host, so it must never start an accelerator backend. One that did would hold device memory the
trainer needs (on an H200, `data.workers=4` ran out of memory at the first step). It also ignores
SIGINT: a terminal's Ctrl-C reaches every process of the group, and the trainer, which turns it
into a clean stop, ends its workers itself (each printed a KeyboardInterrupt traceback)."""

from __future__ import annotations

import os
import signal
import sys

# GPU runtimes' device lists, read when a library in the worker (TensorFlow for data.reader=tfdata)
# starts CUDA or ROCm: empty means no device. JAX itself, on any accelerator, obeys jax_platforms.
HIDDEN_DEVICES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def host_only_worker(worker_index: int = 0, worker_count: int = 1) -> None:
    """Grain's `worker_init_fn`: JAX may use the CPU only, and no runtime sees a device.

    It runs in the fresh (spawned) worker before the dataset is unpickled, but after Grain's own
    import brought JAX in, which had already read `JAX_PLATFORMS`: hence the config update too.
    No backend exists yet at that point (tests/test_grain_workers.py), and JAX starts only the
    platforms `jax_platforms` names."""
    del worker_index, worker_count  # Grain passes them; every worker is set up the same way
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["JAX_PLATFORMS"] = "cpu"
    for name in HIDDEN_DEVICES:
        os.environ[name] = ""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.config.update("jax_platforms", "cpu")
