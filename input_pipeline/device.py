"""The device feed: the next batches become global sharded `jax.Array`s on a background thread
while the current step runs, so a step never starts by copying its input."""

from __future__ import annotations

import math
import mmap
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from input_pipeline.errors import DataError
from input_pipeline.streams import close_readers

_END = object()
# How often a wait for a batch that has not come asks whether to give up (`next_unless`): a stop
# request is seen this long after its signal at most. A batch already there is taken at once.
POLL_S = 0.1


def _never() -> bool:
    return False


def row_feeders(sharding: NamedSharding) -> tuple[int, int]:
    """`(index, count)`: this process's place among the processes that feed distinct rows of a
    batch laid out by `sharding`, and how many such row blocks there are. Processes whose devices
    hold the same rows (an axis the batch is replicated over, such as `tensor`, spanning hosts)
    must feed the same rows, so they share an index; usually this is
    `(process_index, process_count)`."""
    if jax.process_count() == 1:
        return 0, 1
    rows = sharding.mesh.devices.size  # every split of the row axis divides it
    spans: dict[int, tuple[int, int]] = {}
    for device, (index, *_) in sharding.devices_indices_map((rows, 1)).items():
        start, stop, _ = index.indices(rows)
        low, high = spans.get(device.process_index, (start, stop))
        spans[device.process_index] = (min(low, start), max(high, stop))
    return row_block_of(spans, jax.process_index(), rows)


def row_block_of(spans: Mapping[int, tuple[int, int]], process: int, rows: int) -> tuple[int, int]:
    """`(index, count)` of `process`'s row span among the distinct spans of all processes, which
    must tile `rows` in equal blocks."""
    blocks = sorted(set(spans.values()))
    size = rows // len(blocks)
    if blocks != [(i * size, (i + 1) * size) for i in range(len(blocks))]:
        raise DataError(
            f"the batch's row blocks per process {blocks} do not tile its {rows} rows evenly; "
            "give every process the same number of devices of each mesh axis"
        )
    return blocks.index(spans[process]), len(blocks)


def to_global(
    batch: Mapping[str, np.ndarray], sharding: NamedSharding, feeders: int = 1
) -> dict[str, jax.Array]:
    """This host's rows -> one global array per field (every row block in order, each fed by
    `feeders`' processes: `row_feeders`), each with `sharding`, the one the jitted steps declare."""
    local = {name: in_own_memory(np.asarray(value)) for name, value in batch.items()}
    try:
        if jax.process_count() == 1:  # this host's rows are the global batch
            # the transfers `jax.device_put` makes, in half its host time (a 64 x 256 batch on
            # the 2-core CPU: 0.21 ms, not 0.44), which the feed thread takes from the loop's cores
            return {
                name: jax.make_array_from_callback(value.shape, sharding, value.__getitem__)
                for name, value in local.items()
            }
        return jax.make_array_from_process_local_data(
            sharding, local, _global_shapes(local, feeders)
        )
    except ValueError:  # jax's own error names its sharding internals, not the batch or the fix
        _check_rows_divide(_global_shapes(local, feeders), sharding)
        raise


def in_own_memory(value: np.ndarray) -> np.ndarray:
    """`value`, copied if it lies in a memory map: a Grain worker's batch in shared memory. JAX's
    CPU arrays alias the host arrays they are made from, and JAX may let go of one only at its
    next transfer: the last batches of a run stayed in /dev/shm after the run waited for Grain to
    unlink them (`wait_for_dropped_batches`), until the interpreter's exit, and Python's resource
    tracker then warned of "leaked shared_memory objects". With a copy placed, the batch itself
    is dropped as soon as it is placed, and Grain unlinks it."""
    return np.array(value) if _in_memory_map(value) else value


def _in_memory_map(value: np.ndarray) -> bool:
    """Whether the memory under `value` (through its views) is a memory map's."""
    base = value.base
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return isinstance(base, mmap.mmap)


def _global_shapes(local: Mapping[str, np.ndarray], feeders: int) -> dict[str, tuple[int, ...]]:
    return {name: (value.shape[0] * feeders, *value.shape[1:]) for name, value in local.items()}


def _check_rows_divide(shapes: Mapping[str, tuple[int, ...]], sharding: NamedSharding) -> None:
    """A caller's batch whose rows do not split over the devices the rows are spread on."""
    axes = sharding.spec[0] if sharding.spec else None
    names = axes if isinstance(axes, tuple) else (axes,)
    blocks = math.prod(sharding.mesh.shape[name] for name in names if name is not None)
    for name, shape in shapes.items():
        if not shape or shape[0] % blocks:
            raise DataError(
                f"batch field {name!r} has shape {shape}: its rows do not split over the "
                f"{blocks} devices of mesh {'x'.join(n for n in names if n)}; yield batches of "
                f"a multiple of {blocks} rows (whole examples, not one example per item)"
            )


class DeviceFeed:
    """Iterate `(global_batch, data_state)`; `data_state` is the host iterator's state right after
    that batch was read, i.e. what a checkpoint taken after consuming it must store.

    One background thread reads a host batch, takes the iterator's state and places the batch on
    the devices; at most `prefetch` placed batches wait (and one more is being made). Reading
    and placing share one thread: both are mostly Python holding the GIL, so a second thread
    would add a hand-over and overlap nothing. `feeders`: `row_feeders(sharding)`'s count, which
    the run computes once.

    Kept over Grain's `device_put` (two threads and `jax.device_put`): slower in
    BENCHMARKS.md "Input pipeline alone" (1) and "The loop's own cost"; and no `ready()`."""

    def __init__(
        self,
        host_iterator: Iterator,
        sharding: NamedSharding,
        prefetch: int = 4,
        feeders: int | None = None,
    ):
        self._iterator = host_iterator
        self._sharding = sharding
        self._feeders = row_feeders(sharding)[1] if feeders is None else feeders
        # not a SimpleQueue: its get(timeout) in CPython 3.11 and 3.12 waits forever when a signal
        # handled during the wait outlasts the timeout (a SIGTERM at a blocked source hung runs)
        self._ready: queue.Queue = queue.Queue()
        self._free_slots = threading.Semaphore(max(1, prefetch))
        self._stop = threading.Event()
        self.last_wait_s = 0.0
        self._given_up = False  # the run is stopping: `close` does not wait for a read
        self._reading = False  # the thread is in the source's `next`, which may never return
        self._phase = threading.Lock()  # `_reading` and `_stop`, seen together
        self._thread = threading.Thread(target=self._fill, name="device-feed", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        """Host batch, the iterator's state after it, global arrays: in order, each into a free
        slot; the end or an error passes through (and needs no slot)."""
        try:
            while self._start_read():
                try:
                    host_batch = next(self._iterator)
                except StopIteration:
                    self._ready.put(_END)
                    return
                finally:
                    self._reading = False
                state = self._iterator.get_state() if hasattr(self._iterator, "get_state") else None
                item = (to_global(host_batch, self._sharding, self._feeders), state)
                if not self._take_free_slot():
                    return
                self._ready.put(item)
        except BaseException as err:  # re-raised in the consumer, never swallowed
            self._ready.put(err)

    def _start_read(self) -> bool:
        """Whether to read the next batch: never once `close` began, which then knows that the
        thread is not in the source, and waits for it."""
        with self._phase:
            self._reading = not self._stop.is_set()
            return self._reading

    def _take_free_slot(self) -> bool:
        while not self._stop.is_set():
            if self._free_slots.acquire(timeout=0.1):
                return True
        return False

    def __iter__(self) -> DeviceFeed:
        return self

    def ready(self) -> bool:
        """Whether `next` returns without waiting (a batch, the end or an error is there)."""
        return not self._ready.empty()

    def __next__(self) -> tuple[dict[str, jax.Array], Any]:
        return self.next_unless(_never)  # never None: it never gives up

    def next_unless(self, stopped: Callable[[], bool]) -> tuple[dict[str, jax.Array], Any] | None:
        """`next`, or None once `stopped()` is true while no batch has come: a wait on a source
        that never returns can still end. `stopped` is asked only while waiting."""
        start = time.perf_counter()
        while True:
            try:
                item = self._ready.get(timeout=POLL_S)  # at once when a batch is there
                break
            except queue.Empty:
                if stopped():
                    self.give_up()
                    return None
        self.last_wait_s = time.perf_counter() - start
        return self._take(item)

    def _take(self, item: Any) -> tuple[dict[str, jax.Array], Any]:
        if item is _END:
            self._ready.put(_END)  # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            self._ready.put(item)
            raise item
        self._free_slots.release()
        return item

    def give_up(self) -> None:
        """The run is stopping (a stop request): `close` will not wait for a read from the
        source, which may never return (a dead mount) and would cost the stop's grace period."""
        self._given_up = True

    def close(self) -> None:
        """Stop the thread; wait for it, unless the feed was given up (`give_up`, or a wait in
        `next_unless` that a stop ended) while the thread is in the source: it then leaves once
        the source returns. The readers behind the iterator are then closed here
        (`close_readers`), Grain's worker processes stopped in order: left to the exit's
        finalizers, their stop raced their own threads' (a Grain traceback after a data error)."""
        with self._phase:
            self._stop.set()  # no read starts after this
            in_source = self._reading
        self._thread.join(timeout=0 if in_source and self._given_up else 10)
        if not self._thread.is_alive():
            close_readers(self._iterator)

    def __enter__(self) -> DeviceFeed:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self.give_up()  # an abort (a second Ctrl-C): not held up by a read that is stuck
        self.close()
