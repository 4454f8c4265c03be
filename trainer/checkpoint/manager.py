"""Orbax's CheckpointManager adapted: its options, its barriers kept, its failures quietened."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from input_pipeline import checkpointing as data_checkpointing
from trainer.checkpoint.failures import storage_problem
from trainer.config import CheckpointConfig


def open_manager(directory: Path, options: ocp.CheckpointManagerOptions) -> ocp.CheckpointManager:
    """A manager of `directory` that knows the data position's item."""
    with quiet_orbax():  # it logs each unreadable step metadata file it lists
        return _Manager(
            directory,
            options=options,
            handler_registry=data_checkpointing.handler_registry(),
        )


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, except that it never asks JAX's preemption sync point itself: that point
    is asked once per step, by the loop alone (`StopRequest.at_step`). JAX keeps one counter per
    process, the step of its latest question; Orbax's finalize thread asked again with the step
    of an earlier save, which moved process 0's counter back, so the sync could pick a step its
    loop had already passed: process 0 trained on alone while the others stopped, and waited
    for them in the next step's collective forever. Orbax's only uses of the answer are to save
    on that step anyway (the loop saves it) and to log it."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._opening, self._listing_error = True, None
        try:
            super().__init__(*args, **kwargs)
        except Exception:
            self._wait_for_the_cleanup()
            raise
        self._opening = False
        if self._listing_error is not None:
            self._wait_for_the_cleanup()
            raise self._listing_error

    def _load_checkpoint_infos(self, *args: Any, **kwargs: Any) -> Any:
        """Orbax's listing of the steps; one that fails while the manager opens fails it once
        Orbax's constructor is done: raised from the listing, this process skipped the barrier
        that ends the constructor, where the other processes waited for it."""
        try:
            return super()._load_checkpoint_infos(*args, **kwargs)
        except OSError as err:
            if not self._opening:
                raise
            self._listing_error = err
            return []

    def _wait_for_the_cleanup(self) -> None:
        """Orbax's removal of a killed run's partial saves, which lists the folder on a thread of
        its own, started before the listing that failed: never closed, a manager that failed to
        open left it running, and it printed a traceback when the process exited under it. Its
        own error is the same one, reported by the caller."""
        cleanup = getattr(self, "_cleanup_tmp_directory_future", None)
        if cleanup is not None:
            with contextlib.suppress(Exception):
                cleanup.result()

    def reached_preemption(self, step: int) -> bool:
        return False

    def restore(self, step: int | None, *args: Any, **kwargs: Any) -> Any:
        """Orbax's restore; one that fails on this process still meets the others at the
        barrier that ends Orbax's (`Checkpointer:restore`), where those it did not fail on
        wait for it: without it, this process's next collective met theirs there."""
        try:
            return super().restore(step, *args, **kwargs)
        except Exception:
            self._meet_at_the_restore_barrier()
            raise

    def _meet_at_the_restore_barrier(self) -> None:
        """The barrier of orbax 0.12's `Checkpointer.restore`, by its name and processes."""
        checkpointer = self._checkpointer
        prefix = getattr(checkpointer, "_barrier_sync_key_prefix", None)
        ocp.multihost.sync_global_processes(
            ocp.multihost.unique_barrier_key("Checkpointer:restore", prefix=prefix),
            processes=getattr(checkpointer, "_active_processes", None),
        )


@contextlib.contextmanager
def closed_on_error(manager: ocp.CheckpointManager) -> Iterator[None]:
    """Close `manager` when the block raises: the caller will never get to."""
    try:
        yield
    except BaseException:
        manager.close()
        raise


def manager_options(config: CheckpointConfig, writable: bool) -> ocp.CheckpointManagerOptions:
    """The run's own folder: kept, cleaned and saved to as configured. Another run's (export,
    generate, init_from): read-only, with none of the options Orbax would drop with a warning
    each (`setting max_to_keep=None`)."""
    if not writable:
        return ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    return ocp.CheckpointManagerOptions(
        max_to_keep=config.keep,
        keep_period=config.keep_every,  # steps divisible by it are never deleted
        enable_async_checkpointing=config.async_,
        cleanup_tmp_directories=True,  # partial saves of a killed run are removed
    )


class _ReportedStorageErrors(logging.Filter):
    """Holds back Orbax's log of a write that failed on a full or unwritable folder."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and storage_problem(record.exc_info[1]))


@contextlib.contextmanager
def background_failures_reported_by_us() -> Iterator[None]:
    """While open, a save that fails in Orbax's background threads is reported once, by
    `Checkpointer._storage_errors`, not as tracebacks: each of its threads logs a full or
    unwritable folder's error with one (held back here), and its event loop, closed at the first
    failed write, abandons the sibling writes, each of which prints "RuntimeError: Event loop is
    closed" when it ends (drained here, as restores are)."""
    absl = logging.getLogger("absl")
    reported = _ReportedStorageErrors()
    absl.addFilter(reported)
    try:
        with draining_event_loops():
            yield
    finally:
        absl.removeFilter(reported)


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """Orbax logs a failed read from its own threads (absl errors, asyncio tracebacks); the
    caller reports the failure in one line instead."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


class _DrainingLoop(asyncio.SelectorEventLoop):
    """An event loop that lets its pending tasks finish before it closes, and that leaves a full
    or unwritable folder to `Checkpointer`'s one line: a write that failed after its sibling's
    failure had ended the save was logged, when collected, as "Task exception was never
    retrieved" with its traceback, whenever it finished before the loop closed."""

    def close(self) -> None:
        pending = set() if self.is_closed() else asyncio.all_tasks(self)
        if pending and not self.is_running():
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        failure = context.get("exception")
        if failure is None or not storage_problem(failure):
            super().call_exception_handler(context)


class _DrainingPolicy(asyncio.AbstractEventLoopPolicy):
    """The current event loop policy, except that the loops it makes are `_DrainingLoop`s."""

    def __init__(self, inner: asyncio.AbstractEventLoopPolicy):
        self.inner = inner

    def get_event_loop(self) -> asyncio.AbstractEventLoop:
        return self.inner.get_event_loop()

    def set_event_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.inner.set_event_loop(loop)

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _DrainingLoop()


@contextlib.contextmanager
def draining_event_loops() -> Iterator[None]:
    """While open, a closing event loop first lets its pending tasks finish. Orbax runs each
    restore on a fresh loop (`asyncio_utils.run_sync`) and closes it as soon as the restore
    raises, but `asyncio.gather` leaves the failed read's siblings running: abandoned on a closed
    loop, each printed "Exception ignored in: <coroutine _read_array_index_and_device_put>" when
    collected, often at exit (its `except BaseException` turns the GeneratorExit into an error).
    Drained, they end with the restore, which then takes no longer than a whole read."""
    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_DrainingPolicy(policy))
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(policy)
