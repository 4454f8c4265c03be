"""The device feed: the next batches become global sharded `jax.Array`s on a background thread
while the current step runs, so a step never starts by copying its input."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

_END = object()


def to_global(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """This host's rows -> one global array per field (rows of all hosts, in process order)."""
    processes = jax.process_count()

    def place(local: np.ndarray) -> jax.Array:
        global_shape = (local.shape[0] * processes, *local.shape[1:])
        return jax.make_array_from_process_local_data(sharding, local, global_shape)

    return {name: place(np.asarray(value)) for name, value in batch.items()}


class DeviceFeed:
    """Iterate `(global_batch, data_state)`; `data_state` is the host iterator's state right after
    that batch was read, i.e. what a checkpoint taken after consuming it must store."""

    def __init__(self, host_iterator: Iterator, sharding: NamedSharding, prefetch: int = 2):
        self._iterator = host_iterator
        self._sharding = sharding
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self.last_wait_s = 0.0
        self._thread = threading.Thread(target=self._fill, name="device-feed", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            for host_batch in self._iterator:
                state = self._iterator.get_state() if hasattr(self._iterator, "get_state") else None
                item = (to_global(host_batch, self._sharding), state)
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as err:  # re-raised in the consumer, never swallowed
            self._put(err)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> DeviceFeed:
        return self

    def __next__(self) -> tuple[dict[str, jax.Array], Any]:
        start = time.perf_counter()
        item = self._ready.get()
        self.last_wait_s = time.perf_counter() - start
        if item is _END:
            self._ready.put(_END)  # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            self._ready.put(item)
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> DeviceFeed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
