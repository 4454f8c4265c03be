"""The Checkpointer: which step to restore, damaged ones set aside, saves checked and started."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from input_pipeline.errors import DataError
from trainer.checkpoint.failures import (
    chain_has,
    damage_in,
    interrupt_in,
    os_error,
    read_problem,
    storage_problem,
)
from trainer.checkpoint.items import save_args, state_bytes
from trainer.checkpoint.manager import (
    background_failures_reported_by_us,
    closed_on_error,
    draining_event_loops,
    manager_options,
    open_manager,
    quiet_orbax,
)
from trainer.checkpoint.reading import (
    DAMAGED,
    RESTORED,
    STOPS,
    FailedElsewhereError,
    StepReader,
    worst_on_any_process,
)
from trainer.config import CheckpointConfig
from trainer.errors import ConfigError, TrainingError
from trainer.parallel.agreement import (
    gather_rows,
    stop_every_process_if,
    stop_every_process_on_error,
    stop_every_process_with_kind,
)
from trainer.parallel.state import TrainState

T = TypeVar("T")

# What kept a process from starting a save, as the others are told: the save's one all-gather.
NOT_WRITABLE, NO_ROOM = 1, 2


class Checkpointer(StepReader):
    """A thin, explicit wrapper over `ocp.CheckpointManager` for this trainer's items; the reads
    of one step (`restore`, `restore_params`, `read_meta`, `run_config`) are `StepReader`'s."""

    def __init__(self, directory: str | Path, config: CheckpointConfig, create: bool = True):
        self.directory = Path(directory).absolute()
        self.read_only = not create  # another run's folder (init_from, export): never moved
        self.config = config
        self._warming: Checkpointer | None = None  # `warm_up`'s throwaway save, until written
        self._saving: contextlib.ExitStack | None = None  # from the first save until `close`
        self.options = manager_options(config, writable=create)
        _stop_every_process_if(self._listing_problem(), "read", self.directory)
        if create:
            _stop_every_process_if(self._creation_problem(), "create", self.directory)
        self._open_on_every_process(create)

    def _listing_problem(self) -> TrainingError | None:
        """An existing folder that cannot be listed (an NFS mount's EIO or ESTALE, a permission)
        is a read error to name as one, found before Orbax's manager lists it also on a thread
        of its own, whose traceback would follow the line at exit."""
        try:
            os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return None  # for the manager to create, or to refuse in its own line
        except OSError as err:
            return self._unreadable(err)
        return None

    def _creation_problem(self) -> TrainingError | None:
        """The folder, made on process 0 before Orbax's manager would make it there, alone:
        a failure inside Orbax left the other processes waiting at its next barrier."""
        if jax.process_index() != 0:
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return self._uncreatable(err)
        return None

    def _uncreatable(self, err: OSError) -> TrainingError:
        return TrainingError(
            f"cannot create checkpoint folder {self.directory}: {err.strerror}; "
            "choose a writable run.workdir"
        )

    def _unreadable(self, err: OSError) -> TrainingError:
        return TrainingError(
            f"cannot read checkpoint folder {self.directory} ({os_error(err.errno)}); nothing "
            "in it was changed: check the storage it is on (its mount, its permissions) and re-run"
        )

    def _open_on_every_process(self, create: bool) -> None:
        """`self.manager`, opened (and, when `create`, found to take new files: a run that
        cannot save should not train) on every process, or on none."""
        opening = f"opening checkpoint folder {self.directory}"
        elsewhere = functools.partial(_stopped_elsewhere, doing="open", directory=self.directory)
        with contextlib.ExitStack() as opened, stop_every_process_on_error(opening, elsewhere):
            self.manager = self._open_manager_or_refuse()
            opened.enter_context(closed_on_error(self.manager))  # also when another one failed
            if create:
                self._check_writable("starting the run")

    def _open_manager_or_refuse(self) -> ocp.CheckpointManager:
        """A new manager, or one line: a folder that exists failed to be read (its listing
        failed since `_listing_problem` looked), one that does not failed to be made."""
        existed = self.directory.is_dir()
        try:
            return self._open_manager()
        except OSError as err:
            raise (self._unreadable(err) if existed else self._uncreatable(err)) from None

    def _open_manager(self, clean: bool = True) -> ocp.CheckpointManager:
        """A fresh manager: it caches the step list and, after one restore, the item layout.
        The first one removes a killed run's partial saves (when writable), on a thread Orbax's
        `close` does not wait for: a reopened one skips that, lest the thread still be running
        when a run exits at once (it prints a traceback then)."""
        options = self.options
        if not clean:
            options = dataclasses.replace(options, cleanup_tmp_directories=False)
        return open_manager(self.directory, options)

    @classmethod
    def open_existing(
        cls, path: str | Path, fix: str = "give the run.workdir of a past run"
    ) -> tuple[Checkpointer, int]:
        """The latest checkpoint under a run's workdir or its `checkpoints/` folder; `fix` is
        what the caller's user should do when there is none. Every process finds both, or
        every process stops (a host whose mount lacks the run, or lists it late)."""
        path = Path(path)
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        missing = None if folder.is_dir() else TrainingError(f"{path} holds no checkpoints; {fix}")
        _stop_every_process_if(missing, "find", folder)
        checkpointer = cls(folder, CheckpointConfig(), create=False)
        step = checkpointer.latest_step()
        empty = TrainingError(f"{folder} holds no complete checkpoint; {fix}")
        with closed_on_error(checkpointer.manager):
            _stop_every_process_if(empty if step is None else None, "list a checkpoint in", folder)
        return checkpointer, step  # type: ignore[return-value]  # None stopped every process

    def newest_step(self) -> int | None:
        """`latest_step`, the same on every process, or one line on each."""
        step = self.latest_step()
        self._same_step_on_every_process(step)
        return step

    def nothing_to_resume(self) -> bool:
        """Whether no step is listed and none was set aside as damaged (a run never starts afresh
        over them), agreed by every process in the all-gather of the newest step (`newest_step`'s):
        a host whose listing of `*.damaged` lagged started afresh while the others stopped."""
        step = self.latest_step()
        seen = step is None and bool(self.damaged())
        damaged_anywhere = self._same_step_on_every_process(step, damaged=seen)
        return step is None and not damaged_anywhere

    def _same_step_on_every_process(self, step: int | None, damaged: bool = False) -> bool:
        """Stop every process unless each is about to read the same `step` (None: it lists none,
        or none older): a host whose listing of the shared folder lags (a network filesystem's
        cache) read another step than the others, and the model's shards came from two steps,
        or it started afresh while they restored. Returns whether any process gave `damaged`."""
        mine = np.array([-1 if step is None else step, damaged], np.int32)
        everyone, _ = gather_rows(mine)
        steps = everyone[:, 0]
        if (steps == steps[0]).all():
            return bool(everyone[:, 1].any())
        listed = ", ".join(
            f"process {i}: {'none' if s < 0 else f'step {s}'}" for i, s in enumerate(steps)
        )
        raise TrainingError(
            f"the processes list other checkpoints in {self.directory} (the newest to read, "
            f"{listed}): their hosts see the folder differently (a network filesystem's cache "
            "not yet refreshed, or another folder at that path); nothing was read or changed: "
            "re-run once every host lists the same steps"
        )

    def latest_step(self) -> int | None:
        """Latest *complete* step: Orbax only lists finalized step folders."""
        return self.manager.latest_step()

    def damaged(self) -> list[str]:
        """Step folders moved aside by an earlier restore: a run never starts afresh over them."""
        return sorted(p.name for p in self.directory.glob("*.damaged*"))

    def restore_newest(
        self,
        restore: Callable[[int], T],
        steps: list[int] | None = None,
        advice: str = "start fresh with another run.workdir, or repair them (rename a repaired "
        "one back to its step number) and re-run",
        newest_agreed: bool = False,
    ) -> tuple[int, T]:
        """`(step, restore(step))` for the newest of `steps` (default: all) that restores
        completely. One whose own files are damaged is named in one warning line and, in the
        run's own folder, moved aside to `<step>.damaged` (never deleted); then the next older one
        is tried. Any other failure (a read error of the storage, memory, an interrupt, a config
        to fix, a bug) ends the search with every checkpoint left in place (`_try_restore`).
        `newest_agreed`: the caller's `newest_step()` (or `nothing_to_resume()`) agreed the newest
        of all steps already."""
        listed = sorted(self.manager.all_steps() if steps is None else steps, reverse=True)
        agreed = newest_agreed and steps is None
        for tried, step in enumerate(listed):
            if tried or not agreed:
                self._same_step_on_every_process(step)
            value, reason = self._try_restore(restore, step)
            if reason is None:
                return step, value
            outcome = self._set_aside(step)
            _warn(
                f"warning: checkpoint {self.directory / str(step)} does not restore ({reason}); "
                f"{outcome}; trying the previous one"
            )
        if listed or not agreed:
            self._same_step_on_every_process(None)
        kept = self.damaged()
        aside = f" (damaged ones moved aside: {', '.join(kept)})" if kept else ""
        raise TrainingError(f"no checkpoint in {self.directory} restores{aside}; {advice}")

    @classmethod
    def restore_past_run(
        cls,
        workdir: str | Path,
        step: int | None,
        restore: Callable[[Checkpointer, int], T],
        advice: str,
    ) -> tuple[int, T]:
        """`(step, restore(checkpointer, step))` of a past run's step asked for by number, or
        (None) of its newest that restores, damaged ones named and skipped; the checkpoints are
        closed after: what export and generate read."""
        checkpointer, _ = cls.open_existing(workdir)
        try:
            if step is not None:
                checkpointer._stop_unless_listed(step)
            chosen = None if step is None else [step]
            read = functools.partial(restore, checkpointer)
            return checkpointer.restore_newest(read, chosen, advice)
        finally:
            checkpointer.close()

    def _stop_unless_listed(self, step: int) -> None:
        """Stop every process when one does not list `step` (its host's listing not refreshed
        yet): the others would go on to read it, and wait for that one at Orbax's barrier."""
        saved = sorted(self.manager.all_steps())
        absent = TrainingError(f"{self.directory} has no step {step}; saved steps: {saved}")
        where = self.directory
        _stop_every_process_if(None if step in saved else absent, f"find step {step} in", where)

    def _try_restore(self, restore: Callable[[int], T], step: int) -> tuple[T | None, str | None]:
        """The restored value, or the reason the step is damaged, agreed by every process (a
        damage only some processes read is a damage for all). A failure that is no evidence of
        damage, on any process, ends every process here with the checkpoints left in place: a
        transient read error moving a good checkpoint aside would silently resume from an older
        one. An interrupt that Orbax's read wrapped is raised again as itself, once agreed."""
        value, failure = None, None
        with quiet_orbax(), draining_event_loops():
            try:
                value = restore(step)
            except Exception as err:
                failure = err
        own = None if isinstance(failure, FailedElsewhereError) else failure
        interrupt = None if own is None else interrupt_in(own)
        damage = None if own is None or interrupt else damage_in(own)
        outcome = RESTORED if own is None else DAMAGED if damage else STOPS
        agreed = worst_on_any_process(outcome)  # a failure elsewhere: at least DAMAGED there
        if agreed == STOPS:
            raise interrupt or self._left_in_place(step, own)
        if agreed == DAMAGED:
            return None, damage or "it failed to restore on another process"
        return value, None

    def _left_in_place(self, step: int, failure: Exception | None) -> Exception:
        """What ends the run when `step` failed to restore for a reason other than damage
        (`failure`: this process's, None when only another process failed)."""
        where = self.directory / str(step)
        kept = "it is left in place, as are the older ones"
        if failure is None:
            return TrainingError(
                f"checkpoint {where} did not restore on another process (its own line says "
                f"why); {kept}"
            )
        if isinstance(failure, ConfigError | DataError | TrainingError):
            return failure  # the user's to fix, in its own line
        if (problem := read_problem(failure)) is not None:
            return TrainingError(
                f"cannot read checkpoint {where} ({problem}); {kept}: check the storage it is on "
                f"and re-run, or rename it to {step}.damaged to resume from the one before"
            )
        if chain_has(failure, MemoryError):
            return TrainingError(
                f"ran out of host memory while restoring checkpoint {where}; {kept}: free memory "
                "on this host (fewer data.workers) and re-run"
            )
        failure.add_note(f"checkpoint {where} is left in place: this error shows no damage in it")
        return failure  # a bug: its traceback is the honest report

    def _set_aside(self, step: int) -> str:
        """Rename a damaged step folder (process 0), so the next run does not retry it; says
        what became of it."""
        self.manager.close()  # a new manager: the old one caches the step list and item layout
        if self.read_only:
            outcome = "left in place (another run's folder)"
        else:
            outcome = self._rename_damaged(step)
        self.manager = self._open_manager(clean=False)
        return outcome

    def _rename_damaged(self, step: int) -> str:
        folder = self.directory / str(step)
        target, n = folder.with_name(f"{step}.damaged"), 0
        while target.exists():
            n += 1
            target = folder.with_name(f"{step}.damaged.{n}")
        problem = None
        if jax.process_index() == 0:
            try:
                folder.rename(target)
            except OSError as err:
                problem = err.strerror
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
        return f"could not move it aside ({problem})" if problem else f"moved it to {target.name}"

    def save(
        self, step: int, state: TrainState, data_state: dict | None, meta: dict[str, Any]
    ) -> float:
        """Start a save; returns the seconds the caller was blocked (device-to-host copy)."""
        jax.block_until_ready(state)  # time the copy, not the step that is still running
        self._stop_every_process_unless_saving(step, state)
        start = time.perf_counter()
        self._finish_warm_up()  # one save at a time, as Orbax does within one manager
        if self._saving is None:  # failures in Orbax's threads: reported by us, once
            self._saving = contextlib.ExitStack()
            self._saving.enter_context(background_failures_reported_by_us())
        with self._storage_errors(f"saving step {step}"):
            self.manager.save(step, args=save_args(state, data_state, meta))
        return time.perf_counter() - start

    def _stop_every_process_unless_saving(self, step: int, state: TrainState) -> None:
        """Stop every process when one refuses to start the save (a folder that takes no new
        file, a disk without room for it), asked before any process starts it: one that raised
        alone left the others waiting at Orbax's first save barrier. The others' line fits the
        kind of problem that process met (one all-gather carries it)."""
        failure, kind = self._save_problem(step, state)
        directory = self.directory

        def elsewhere(process: int, kind: int) -> TrainingError:
            if kind == NO_ROOM:
                return TrainingError(
                    f"process {process} found no room for the save of step {step} in checkpoint "
                    f"folder {directory} (its own log says how much it needs); nothing in it was "
                    "changed: free space there, lower checkpoint.keep, or point run.workdir at a "
                    "larger disk"
                )
            return _stopped_elsewhere(process, "save into", directory)

        stop_every_process_with_kind(failure, kind, elsewhere)

    def _save_problem(self, step: int, state: TrainState) -> tuple[TrainingError | None, int]:
        """Why this process refuses to start the save, and its kind (`NOT_WRITABLE`,
        `NO_ROOM`); `(None, 0)` when it can start it."""
        try:
            self._check_writable(f"saving step {step}")
        except TrainingError as err:
            return err, NOT_WRITABLE
        try:
            self._check_free_space(step, state)
        except TrainingError as err:
            return err, NO_ROOM
        return None, 0

    def warm_up(self, state: TrainState, meta: dict[str, Any]) -> None:
        """A throwaway save of `state` into `<directory>.warm_up` (deleted once written) before
        the first step: what Orbax and the runtime set up on first use (handlers, thread pools,
        TensorStore, the slicing it compiles per array shape, host buffers for the copy) is then
        in place, and the first real save blocks no longer than the ones after it (BENCHMARKS.md,
        "The loop's own cost")."""
        folder = self.directory.with_name(self.directory.name + ".warm_up")
        needed = state_bytes(state)
        no_room = folder.parent.is_dir() and needed > shutil.disk_usage(folder.parent).free
        everyone, _ = gather_rows(np.array(no_room, np.int32))
        if everyone.any():  # read a moment apart: skipped by all or none
            return  # no room for a throwaway copy: the real save's own check speaks for the disk
        warm = Checkpointer(folder, self.config)
        for step in warm.manager.all_steps():  # left by a run killed while warming up
            warm.manager.delete(step)
        warm.save(0, state, None, meta)
        self._warming = warm

    def _finish_warm_up(self) -> None:
        """Wait for the warm-up save's write, then delete it."""
        warm, self._warming = self._warming, None
        if warm is None:
            return
        warm.close()
        if jax.process_index() == 0:
            shutil.rmtree(warm.directory, ignore_errors=True)

    def _check_writable(self, doing: str) -> None:
        """Refuse a save into a folder that takes no new file before Orbax starts it: its
        writer threads would wait 300 s for a step folder that is never made, then print a
        traceback each."""
        if not self.directory.is_dir():
            return
        try:
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as err:
            raise TrainingError(
                f"checkpoint folder {self.directory} is not writable ({err.strerror}) while "
                f"{doing}; fix the permissions there, or point run.workdir elsewhere"
                f"{self._last_good()}"
            ) from None

    def _check_free_space(self, step: int, state: TrainState) -> None:
        """Refuse a save that cannot fit before writing a byte of it, on local disks (where
        the free space is known); older checkpoints are deleted only after a new one is done."""
        if not self.directory.is_dir():
            return
        needed = state_bytes(state)
        free = shutil.disk_usage(self.directory).free
        if needed > free:
            raise TrainingError(
                f"checkpoint folder {self.directory} has {_size(free)} free but the save of "
                f"step {step} needs about {_size(needed)}; free space there, lower "
                f"checkpoint.keep, or point run.workdir at a larger disk{self._last_good()}"
            )

    def _last_good(self) -> str:
        step = self.latest_step()
        return f" (step {step} is the last complete checkpoint)" if step is not None else ""

    @contextlib.contextmanager
    def _storage_errors(self, doing: str) -> Iterator[None]:
        """A full or unwritable checkpoint folder, reported as such: Orbax and TensorStore
        raise it from background threads as assorted errors whose text carries the OS error."""
        try:
            yield
        except Exception as err:
            problem = storage_problem(err)
            if problem is None:
                raise
            raise TrainingError(
                f"checkpoint folder {self.directory} {problem} while {doing}; free space or fix "
                f"the permissions there, or point run.workdir elsewhere{self._last_good()}"
            ) from None

    def wait(self) -> None:
        self._finish_warm_up()
        with self._storage_errors("finishing a save"):
            self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            with self._saving or contextlib.nullcontext(), self._storage_errors("finishing a save"):
                self.manager.close()


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _warn(line: str) -> None:
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def _stop_every_process_if(failure: TrainingError | None, doing: str, directory: Path) -> None:
    """Raise `failure` here, and on every other process a line naming the first process it was
    raised on: `stop_every_process_if`."""

    stop_every_process_if(failure, lambda process: _stopped_elsewhere(process, doing, directory))


def _stopped_elsewhere(process: int, doing: str, directory: Path) -> TrainingError:
    """The line of the processes that did not meet the problem `process` met with the folder."""
    return TrainingError(
        f"process {process} cannot {doing} checkpoint folder {directory} (its own log "
        "says why); nothing in it was changed: check the storage it is on from that host "
        "(its mount, its permissions) and re-run"
    )
