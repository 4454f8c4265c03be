"""Start-up of Grain's worker processes (`data.workers > 0`): a worker reads and packs batches on
the host, so it must never start an accelerator backend. One that did would hold device memory the
trainer needs (on an H200, `data.workers=4` ran out of memory at the first step).

A worker's life is the trainer's to end: Grain's iterator stops its workers when the trainer
exits, and unlinks the shared memory of the batches they made. So a worker ignores SIGINT and
SIGTERM, which a terminal's Ctrl-C and a scheduler's preemption (Slurm signals every process of
the job) send it along with the trainer: each printed a KeyboardInterrupt traceback, and a worker
killed by SIGTERM left its in-flight batches to Python's resource tracker, which warned of
"leaked shared_memory objects" in the job's log. It ends itself when the trainer dies without
stopping it (the watchdog's exit, an out-of-memory kill): it lived on, holding its batches in
/dev/shm, until a scheduler's SIGKILL left them there for good."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading

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
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    exit_with_parent()
    os.environ["JAX_PLATFORMS"] = "cpu"
    for name in HIDDEN_DEVICES:
        os.environ[name] = ""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.config.update("jax_platforms", "cpu")


def exit_with_parent() -> None:
    """End this worker process as soon as the process that started it is gone. Its batches'
    shared memory is then unlinked by the resource tracker, which outlives them both."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not a multiprocessing child: nothing to outlive
        return

    def wait_for_parent() -> None:
        parent.join()  # its sentinel pipe closes when it exits, however it exits
        os._exit(1)

    threading.Thread(target=wait_for_parent, name="exit-with-parent", daemon=True).start()


def wait_for_dropped_batches(timeout_s: float = 10.0) -> None:
    """Wait until Grain has unlinked the shared memory of the worker batches this process has
    dropped. Grain unlinks them in a background thread that the interpreter's exit stops with
    unlinks still queued; Python's resource tracker then unlinks them itself and warns of "leaked
    shared_memory objects" in the run's log (in most runs with `data.workers`). Grain offers no
    public call for this: without its private pool (another Grain version) this does nothing."""
    with contextlib.suppress(ImportError):
        from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

        pool = getattr(SharedMemoryArray, "_del_thread_pool", None)  # made by a worker iterator
        if pool is not None:
            pool.apply_async(int).wait(timeout_s)  # one thread, in order: after the queued unlinks
