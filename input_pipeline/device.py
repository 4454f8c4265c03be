"""The device feed: the next batches become global sharded `jax.Array`s on background threads
while the current step runs, so a step never starts by copying its input.

Two stages, each on its own thread: one pulls host batches (and the iterator state after each)
out of the chain, the other turns them into global arrays. On a fast chain the two cost about the
same (~0.3 ms per 64x1024 batch each on 2 CPU cores), so overlapping them halves the feed's time
per batch; both release the GIL for most of their work (numpy packing, JAX's C++ transfer)."""

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
    """This host's rows -> one global array per field (rows of all hosts, in process order).

    One call for the whole dict: on one process JAX then places every field in a single batched
    transfer (~0.28 ms for a 64x1024 batch on CPU, against ~0.42 ms field by field)."""
    processes = jax.process_count()
    local = {name: np.asarray(value) for name, value in batch.items()}
    global_shapes = {
        name: (value.shape[0] * processes, *value.shape[1:]) for name, value in local.items()
    }
    return jax.make_array_from_process_local_data(sharding, local, global_shapes)


class DeviceFeed:
    """Iterate `(global_batch, data_state)`; `data_state` is the host iterator's state right after
    that batch was read, i.e. what a checkpoint taken after consuming it must store.

    `prefetch` bounds each stage's queue: at most `prefetch` global batches wait on the devices
    and `prefetch` host batches wait for their transfer."""

    def __init__(self, host_iterator: Iterator, sharding: NamedSharding, prefetch: int = 2):
        self._iterator = host_iterator
        self._sharding = sharding
        self._host: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self.last_wait_s = 0.0
        self._threads = [
            threading.Thread(target=self._read, name="device-feed-read", daemon=True),
            threading.Thread(target=self._transfer, name="device-feed-transfer", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _read(self) -> None:
        """Stage 1: host batches and the iterator state after each."""
        try:
            for host_batch in self._iterator:
                state = self._iterator.get_state() if hasattr(self._iterator, "get_state") else None
                if not self._put(self._host, (host_batch, state)):
                    return
            self._put(self._host, _END)
        except BaseException as err:  # re-raised in the consumer, never swallowed
            self._put(self._host, err)

    def _transfer(self) -> None:
        """Stage 2: host batches -> global arrays, in order; the end or an error passes through."""
        while (item := self._get(self._host)) is not None:
            if item is _END or isinstance(item, BaseException):
                self._put(self._ready, item)
                return
            host_batch, state = item
            try:
                item = (to_global(host_batch, self._sharding), state)
            except BaseException as err:
                self._put(self._ready, err)
                return
            if not self._put(self._ready, item):
                return

    def _put(self, channel: queue.Queue, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                channel.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, channel: queue.Queue) -> Any:
        while not self._stop.is_set():
            try:
                return channel.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

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
        for thread in self._threads:
            thread.join(timeout=10)

    def __enter__(self) -> DeviceFeed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
