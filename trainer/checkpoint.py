"""Orbax checkpoints: the train state, every host's data-iterator position, and run metadata in
one step folder, saved asynchronously so the loop blocks only for the device-to-host copy."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import re
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

from input_pipeline import checkpointing as data_checkpointing
from input_pipeline.errors import DataError
from trainer.config import CheckpointConfig, Config, PrecisionConfig, saved_config
from trainer.errors import ConfigError, TrainingError, first_line
from trainer.loss_scale import LossScale, uses_loss_scale
from trainer.parallel.state import TrainState

T = TypeVar("T")

RESUME_ANOTHER_MODEL = "use a new run.workdir or the model config it was saved with"
META_FILE = "meta/metadata"  # in a step's folder: the `meta` item, as Orbax's JsonSave writes it
TREE_FILE = "_METADATA"  # in a pytree item's folder (`params`, `train`): its tree, as StandardSave

# A restore's outcome on one process, agreed across processes as the largest of them.
RESTORED, DAMAGED, STOPS = 0, 1, 2

# What Orbax 0.12 and TensorStore raise for a step's own files that are damaged: an item folder
# missing, a stored array of another shape than the listed one, and TensorStore's status codes for
# bytes that are short, missing or do not decode (an OS error is `UNKNOWN` with its code).
ORBAX_DAMAGE = ("was not found in the checkpoint", "is not compatible with the stored shape")
TENSORSTORE_DAMAGE = ("OUT_OF_RANGE:", "DATA_LOSS:", "FAILED_PRECONDITION:", "NOT_FOUND:")
TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")


class _DamageError(Exception):
    """What a step's own metadata shows to be damaged (valid JSON, but not what a save writes)."""


class _FailedElsewhereError(Exception):
    """An item read that did not fail here, on a process whose peer's read of it did: every
    process leaves the restore at the same read, so their next collective is the same one."""


# Errors that say a step's file is missing or does not parse.
DAMAGED_FILES = (_DamageError, json.JSONDecodeError, UnicodeDecodeError, FileNotFoundError)


def _train_part(state: TrainState) -> dict[str, Any]:
    """Everything but the parameters, saved as its own item so `params` restores alone."""
    part = {"step": state.step, "model_state": state.model_state, "opt_state": state.opt_state}
    if state.loss_scale is not None:  # float16 runs: the scale resumes where it was
        part["loss_scale"] = state.loss_scale
    return part


def _saved_a_loss_scale(meta: dict[str, Any], target: TrainState) -> bool:
    """Whether the step's train item holds a loss scale: its run computed in float16 (a
    checkpoint written without the run's config, by a caller of `save`: as `target`)."""
    if "config" not in meta:
        return target.loss_scale is not None
    return uses_loss_scale(_saved_compute(meta["config"]))


def _saved_compute(config: Any) -> str:
    """`precision.compute` of a saved config. One without the section (hand-edited: every version
    saved it) computed in the default, bfloat16 in every version: as `load_config` reads it."""
    precision = config.get("precision", {}) if isinstance(config, dict) else None
    if not isinstance(precision, dict):
        raise _DamageError(f"its {META_FILE} holds a config that is not a mapping of sections")
    return precision.get("compute", PrecisionConfig().compute)


def _abstract_loss_scale(replicated: jax.sharding.Sharding) -> LossScale:
    """A saved float16 loss scale's restore target, whatever this run's precision."""
    return LossScale(
        scale=jax.ShapeDtypeStruct((), np.float32, sharding=replicated),
        clean_steps=jax.ShapeDtypeStruct((), np.int32, sharding=replicated),
    )


def _changed_keys(
    saved: dict[str, Any], now: dict[str, Any], sections: tuple[str, ...]
) -> list[tuple[str, Any, Any]]:
    """`(section.key, saved value, run's value)` for every key of `sections` that differs."""
    return [
        (f"{section}.{key}", value, now[section].get(key))
        for section in sections
        if section in now
        for key, value in saved.get(section, {}).items()
        if value != now[section].get(key)
    ]


def param_shapes(params: Any) -> dict[str, list[int]]:
    """`path -> shape` of every parameter, saved with each checkpoint to explain mismatches."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): list(np.shape(leaf)) for path, leaf in flat}


class Checkpointer:
    """A thin, explicit wrapper over `ocp.CheckpointManager` for this trainer's items."""

    def __init__(self, directory: str | Path, config: CheckpointConfig, create: bool = True):
        self.directory = Path(directory).absolute()
        self.read_only = not create  # another run's folder (init_from, export): never moved
        self.config = config
        self._warming: Checkpointer | None = None  # `warm_up`'s throwaway save, until written
        self._saving: contextlib.ExitStack | None = None  # from the first save until `close`
        self.options = _manager_options(config, writable=create)
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
            f"cannot read checkpoint folder {self.directory} ({_os_error(err.errno)}); nothing "
            "in it was changed: check the storage it is on (its mount, its permissions) and re-run"
        )

    def _open_on_every_process(self, create: bool) -> None:
        """`self.manager`, opened (and, when `create`, found to take new files: a run that
        cannot save should not train) on every process, or on none."""
        try:
            self.manager = self._open_manager_or_refuse()
            if create:
                with _closed_on_error(self.manager):
                    self._check_writable("starting the run")
        except TrainingError as err:
            _stop_every_process_if(err, "open", self.directory)  # raises: each asks once
        with _closed_on_error(self.manager):
            _stop_every_process_if(None, "open", self.directory)

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
        with _quiet_orbax():  # it logs each unreadable step metadata file it lists
            return _Manager(
                self.directory,
                options=options,
                handler_registry=data_checkpointing.handler_registry(),
            )

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
        with _closed_on_error(checkpointer.manager):
            _stop_every_process_if(empty if step is None else None, "list a checkpoint in", folder)
        return checkpointer, step  # type: ignore[return-value]  # None stopped every process

    def newest_step(self) -> int | None:
        """`latest_step`, the same on every process, or one line on each."""
        step = self.latest_step()
        self._same_step_on_every_process(step)
        return step

    def _same_step_on_every_process(self, step: int | None) -> None:
        """Stop every process unless each is about to read the same `step` (None: it lists none,
        or none older): a host whose listing of the shared folder lags (a network filesystem's
        cache) read another step than the others, and the model's shards came from two steps,
        or it started afresh while they restored."""
        steps = _on_every_process(-1 if step is None else step)
        if (steps == steps[0]).all():
            return
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
    ) -> tuple[int, T]:
        """`(step, restore(step))` for the newest of `steps` (default: all) that restores
        completely. One whose own files are damaged is named in one warning line and, in the
        run's own folder, moved aside to `<step>.damaged` (never deleted); then the next older one
        is tried. Any other failure (a read error of the storage, memory, an interrupt, a config
        to fix, a bug) ends the search with every checkpoint left in place (`_try_restore`)."""
        for step in sorted(self.manager.all_steps() if steps is None else steps, reverse=True):
            self._same_step_on_every_process(step)
            value, reason = self._try_restore(restore, step)
            if reason is None:
                return step, value
            outcome = self._set_aside(step)
            _warn(
                f"warning: checkpoint {self.directory / str(step)} does not restore ({reason}); "
                f"{outcome}; trying the previous one"
            )
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
    ) -> T:
        """`restore(checkpointer, step)` of a past run's step asked for by number, or (None) of
        its newest that restores, damaged ones named and skipped; the checkpoints are closed
        after: what export and generate read."""
        checkpointer, _ = cls.open_existing(workdir)
        try:
            if step is not None:
                checkpointer._stop_unless_listed(step)
            chosen = None if step is None else [step]
            read = functools.partial(restore, checkpointer)
            return checkpointer.restore_newest(read, chosen, advice)[1]
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
        with _quiet_orbax(), _draining_event_loops():
            try:
                value = restore(step)
            except Exception as err:
                failure = err
        own = None if isinstance(failure, _FailedElsewhereError) else failure
        interrupt = None if own is None else _interrupt_in(own)
        damage = None if own is None or interrupt else _damage(own)
        outcome = RESTORED if own is None else DAMAGED if damage else STOPS
        agreed = _worst_on_any_process(outcome)  # a failure elsewhere: at least DAMAGED there
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
        if (problem := _read_problem(failure)) is not None:
            return TrainingError(
                f"cannot read checkpoint {where} ({problem}); {kept}: check the storage it is on "
                f"and re-run, or rename it to {step}.damaged to resume from the one before"
            )
        if _chain_has(failure, MemoryError):
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
        _stop_every_process_if(self._save_problem(step, state), "save into", self.directory)
        start = time.perf_counter()
        self._finish_warm_up()  # one save at a time, as Orbax does within one manager
        if self._saving is None:  # failures in Orbax's threads: reported by us, once
            self._saving = contextlib.ExitStack()
            self._saving.enter_context(_background_failures_reported_by_us())
        with self._storage_errors(f"saving step {step}"):
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(state.params),
                    train=ocp.args.StandardSave(_train_part(state)),
                    data=data_checkpointing.save_args(data_state),
                    meta=ocp.args.JsonSave(meta),
                ),
            )
        return time.perf_counter() - start

    def _save_problem(self, step: int, state: TrainState) -> TrainingError | None:
        """Why this process refuses to start the save (a folder that takes no new file, a disk
        without room for it), asked before any process starts it: one that raised alone left
        the others waiting at Orbax's first save barrier."""
        try:
            self._check_writable(f"saving step {step}")
            self._check_free_space(step, state)
        except TrainingError as err:
            return err
        return None

    def warm_up(self, state: TrainState, meta: dict[str, Any]) -> None:
        """A throwaway save of `state` into `<directory>.warm_up` (deleted once written) before
        the first step: what Orbax and the runtime set up on first use (handlers, thread pools,
        TensorStore, the slicing it compiles per array shape, host buffers for the copy) is then
        in place, and the first real save blocks no longer than the ones after it (an H200 at
        1B blocked 6.4 s in the first async save, 0.30 s in the second)."""
        folder = self.directory.with_name(self.directory.name + ".warm_up")
        needed = _state_bytes(state)
        no_room = folder.parent.is_dir() and needed > shutil.disk_usage(folder.parent).free
        if _on_every_process(int(no_room)).any():  # read a moment apart: skipped by all or none
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
        needed = _state_bytes(state)
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
            problem = _storage_problem(err)
            if problem is None:
                raise
            raise TrainingError(
                f"checkpoint folder {self.directory} {problem} while {doing}; free space or fix "
                f"the permissions there, or point run.workdir elsewhere{self._last_good()}"
            ) from None

    def _read_items(self, step: int, **items: ocp.args.CheckpointArgs) -> Any:
        """`manager.restore` of `items`, failed on every process when it fails on one (with
        `_FailedElsewhereError` where it did not): a process that went on to the next read
        would wait in its barrier for one that never comes, or meet its all-gather there."""
        restored, failure = None, None
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:
            failure = self._shown_damage(step, items, err)
        if _worst_on_any_process(RESTORED if failure is None else STOPS) != RESTORED:
            raise failure or _FailedElsewhereError(f"step {step} failed on another process")
        return restored

    def _shown_damage(
        self, step: int, items: dict[str, ocp.args.CheckpointArgs], failure: Exception
    ) -> Exception:
        """`failure` of a read of `items`; as a `_DamageError` when it is no evidence of damage
        itself (a JAX tree error, a KeyError: what a bug raises too) but a pytree item's tree
        file is missing or does not hold a tree (JSON that does not parse is evidence itself)."""
        if _damage(failure) or _interrupt_in(failure) or _read_problem(failure):
            return failure
        for name, args in items.items():
            if not isinstance(args, ocp.args.StandardRestore):
                continue
            if (problem := _tree_file_problem(self.directory / str(step) / name)) is not None:
                damage = _DamageError(problem)
                damage.__cause__ = failure
                return damage
        return failure

    def read_meta(self, step: int) -> dict[str, Any]:
        """The run's metadata saved with `step` (config, dataset fingerprint, shapes)."""
        restored = self._read_items(step, meta=ocp.args.JsonRestore())
        if not isinstance(restored.meta, dict):  # every save writes a mapping
            raise _DamageError(f"its {META_FILE} is not a JSON object")
        return restored.meta

    def run_config(self, step: int) -> Config:
        """The config the run saved with `step`, its vocabulary filled in: the model to rebuild
        (export, generate)."""
        meta = self.read_meta(step)
        config = saved_config(meta["config"], self.directory / str(step) / META_FILE)
        return config.derive({"model.vocab_size": meta["vocab_size"]})

    def restore(
        self, step: int, target: TrainState, run_config: dict[str, Any] | None = None
    ) -> tuple[TrainState, dict | None, dict[str, Any]]:
        """`(state, data position, metadata)` of `step`: the metadata is the one this restore
        read, for the caller to use rather than read again after the restore.

        Restore onto `target`'s shapes and shardings (so a new mesh reshards on load), memory
        kinds included: offloaded parts (`trainer.parallel.offload`) are read straight into
        pinned host memory, never through the device memory they were offloaded to spare (orbax
        0.12 passes the memory kind through: no memory-kind mismatch, tests/test_offload.py).

        The loss scale is read as saved, whatever this run's precision: the state's
        `loss_scale` is the checkpoint's (None when it computed in bf16/fp32), for the caller
        to keep or replace. Any other change of the state's layout (`run_config`, the run's
        config, against the saved one) is one line, and the checkpoint is left in place."""
        meta = self.read_meta(step)
        self._check_shapes(step, target.params, RESUME_ANOTHER_MODEL, meta)
        part = _train_part(target)
        part.pop("loss_scale", None)
        if _saved_a_loss_scale(meta, target):
            part["loss_scale"] = _abstract_loss_scale(target.step.sharding)
        try:
            restored = self._read_items(
                step,
                params=ocp.args.StandardRestore(target.params),
                train=ocp.args.StandardRestore(part),
            )
        except ValueError as err:
            if not _mentions(str(err), ("tree structures do not match",)):
                raise
            saved = meta.get("config", {})
            raise ConfigError(self._layout_changed(step, saved, run_config)) from None
        train = restored.train
        state = TrainState(
            step=train["step"],
            params=restored.params,
            model_state=train["model_state"],
            opt_state=train["opt_state"],
            loss_scale=train.get("loss_scale"),
        )
        data_state = data_checkpointing.restore_position(
            self.directory / str(step) / "data", jax.process_index(), jax.process_count()
        )
        return state, data_state, meta

    def restore_params(self, step: int, target_params: Any, fix: str = RESUME_ANOTHER_MODEL) -> Any:
        """Parameters only (fine-tuning from another run, export); `fix` ends the line that
        refuses another model's checkpoint."""
        self._check_shapes(step, target_params, fix)
        restored = self._read_items(step, params=ocp.args.StandardRestore(target_params))
        return restored.params

    def _layout_changed(
        self, step: int, saved: dict[str, Any], run_config: dict[str, Any] | None
    ) -> str:
        """The line for a checkpoint whose optimizer or model state is laid out otherwise than
        this run's (`optim.clip_norm` null against a number, `model.dropout` 0 against more)."""
        where = self.directory / str(step)
        changed = _changed_keys(saved, run_config or {}, ("model", "optim"))
        keys = "; ".join(
            f"{k}: saved {json.dumps(a)}, now {json.dumps(b)}" for k, a, b in changed[:4]
        )
        which = f" ({keys})" if keys else ""
        return (
            f"checkpoint {where} holds optimizer or model state laid out otherwise than this "
            f"run's{which}; resume with the settings it was saved with, or start a new "
            f"run.workdir with checkpoint.init_from={self.directory.parent} to keep its weights"
        )

    def _check_shapes(
        self, step: int, target_params: Any, fix: str, meta: dict[str, Any] | None = None
    ) -> None:
        saved = (meta or self.read_meta(step)).get("param_shapes")
        if not isinstance(saved, dict):  # every save writes them: the metadata is damaged
            raise _DamageError("its meta/ item records no parameter shapes")
        wanted = param_shapes(target_params)
        missing = sorted(set(wanted) - set(saved))
        extra = sorted(set(saved) - set(wanted))
        differ = [k for k in sorted(set(saved) & set(wanted)) if saved[k] != wanted[k]]
        if not (missing or extra or differ):
            return
        parts = [f"{k}: saved {saved[k]} vs model {wanted[k]}" for k in differ[:3]]
        parts += [f"{k}: not in checkpoint" for k in missing[:3]]
        parts += [f"{k}: not in model" for k in extra[:3]]
        raise TrainingError(
            f"checkpoint {self.directory / str(step)} is from another model ("
            + "; ".join(parts)
            + f"); {fix}"
        )

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
def _closed_on_error(manager: ocp.CheckpointManager) -> Iterator[None]:
    """Close `manager` when the block raises: the caller will never get to."""
    try:
        yield
    except BaseException:
        manager.close()
        raise


def _state_bytes(state: TrainState) -> int:
    """About what a save of `state` writes (before compression)."""
    return sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(state))


def _manager_options(config: CheckpointConfig, writable: bool) -> ocp.CheckpointManagerOptions:
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


DISK_FULL = ("No space left on device", "os_error_code='28'", "[Errno 28]")
NOT_WRITABLE = ("Permission denied", "Read-only file system", "[Errno 13]", "[Errno 30]")


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _storage_problem(err: BaseException) -> str | None:
    """What a full or unwritable folder did to `err`'s write ("is full ..."), or None."""
    code, text = getattr(err, "errno", None), str(err)
    if code == errno.ENOSPC or _mentions(text, DISK_FULL):
        return "is full (no space left on device)"
    if code in (errno.EACCES, errno.EROFS) or _mentions(text, NOT_WRITABLE):
        return "is not writable"
    return None


class _ReportedStorageErrors(logging.Filter):
    """Holds back Orbax's log of a write that failed on a full or unwritable folder."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _storage_problem(record.exc_info[1]))


@contextlib.contextmanager
def _background_failures_reported_by_us() -> Iterator[None]:
    """While open, a save that fails in Orbax's background threads is reported once, by
    `_storage_errors`, not as tracebacks: each of its threads logs a full or unwritable folder's
    error with one (held back here), and its event loop, closed at the first failed write,
    abandons the sibling writes, each of which prints "RuntimeError: Event loop is closed"
    when it ends (drained here, as restores are)."""
    absl = logging.getLogger("absl")
    reported = _ReportedStorageErrors()
    absl.addFilter(reported)
    try:
        with _draining_event_loops():
            yield
    finally:
        absl.removeFilter(reported)


def _mentions(text: str, phrases: tuple[str, ...]) -> bool:
    return any(phrase in text for phrase in phrases)


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and its causes, outermost first: Orbax wraps TensorStore's error (`OUT_OF_RANGE:
    Error reading ...`), or an interrupt that came during a read, in a generic one."""
    chain = [err]
    for _ in range(20):
        inner = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        if inner is None:
            break
        chain.append(inner)
        err = inner
    return chain


def _chain_has(err: BaseException, kind: type[BaseException]) -> bool:
    return any(isinstance(e, kind) for e in _chain(err))


def _interrupt_in(err: BaseException) -> BaseException | None:
    """A KeyboardInterrupt, a stop (`trainer.preemption.Stopped`) or a SystemExit that Orbax's
    read wrapped in an `Exception` ("Encountered error while reading ..."); a cancelled or closed
    task's error is not one (it shows no damage either: the restore stops, `_left_in_place`)."""
    no_interrupt = (Exception, asyncio.CancelledError, GeneratorExit)
    return next((e for e in _chain(err) if not isinstance(e, no_interrupt)), None)


def _read_problem(err: BaseException) -> str | None:
    """The OS error, other than a missing file, that a read of the checkpoint met ("Stale file
    handle [ESTALE]"): Python's, or TensorStore's `[os_error_code='116']`; or None."""
    for e in _chain(err):
        code = e.errno if isinstance(e, OSError) else None
        if code is None and (found := TENSORSTORE_OS_ERROR.search(str(e))) is not None:
            code = int(found[1])
        if code is not None and code != errno.ENOENT:
            where = f" reading {e.filename}" if getattr(e, "filename", None) else ""
            return f"{_os_error(code)}{where}"
    return None


def _os_error(code: int) -> str:
    """An OS error in words, with its name to search for: "Stale file handle [ESTALE]"."""
    return f"{os.strerror(code)} [{errno.errorcode.get(code, str(code))}]"


def _damage(err: BaseException) -> str | None:
    """Why `err`, a failed restore, shows the step's own files damaged (a file missing, short,
    not decoding or not parsing, an array of another shape than listed), or None: no evidence.
    A read error of the storage is none (`_read_problem` is asked first)."""
    if _read_problem(err) is not None:
        return None
    for e in _chain(err):
        text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if (
            isinstance(e, DAMAGED_FILES)
            or (isinstance(e, KeyError | ValueError) and _mentions(text, ORBAX_DAMAGE))
            or (isinstance(e, ValueError) and text.startswith(TENSORSTORE_DAMAGE))
        ):
            return first_line(e, with_type=False)
    return None


def _tree_file_problem(item: Path) -> str | None:
    """What a pytree item's tree file (every save writes one) shows wrong: missing, not
    parsing, or JSON without Orbax's `tree_metadata`; None when it looks whole, or cannot be
    read (the failure it was asked about then stands)."""
    where = f"{item.name}/{TREE_FILE}"
    try:
        tree = json.loads((item / TREE_FILE).read_bytes())
    except FileNotFoundError:
        return f"its {where} is missing"
    except OSError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"its {where} does not parse ({first_line(err, with_type=False)})"
    if not (isinstance(tree, dict) and isinstance(tree.get("tree_metadata"), dict)):
        return f"its {where} holds no tree"
    return None


def _warn(line: str) -> None:
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def _stop_every_process_if(failure: TrainingError | None, doing: str, directory: Path) -> None:
    """Raise `failure` here, and on every other process a line naming the first process it was
    raised on (one small all-gather): a process that stopped alone left the others waiting in
    their next collective until JAX's coordination service aborted them."""
    failed = np.flatnonzero(_on_every_process(int(failure is not None)))
    if failure is not None:
        raise failure
    if failed.size:
        raise TrainingError(
            f"process {failed[0]} cannot {doing} checkpoint folder {directory} (its own log "
            "says why); nothing in it was changed: check the storage it is on from that host "
            "(its mount, its permissions) and re-run"
        )


def _worst_on_any_process(outcome: int) -> int:
    """The largest of every process's `outcome` (RESTORED < DAMAGED < STOPS), so all pick the
    same checkpoint, and all stop when one must."""
    return int(np.max(_on_every_process(outcome)))


def _on_every_process(value: int) -> np.ndarray:
    """Every process's `value`, by process index: one small all-gather (alone: no call)."""
    if jax.process_count() == 1:
        return np.array([value])
    return np.asarray(multihost_utils.process_allgather(np.array(value, np.int32))).reshape(-1)


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
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
    """An event loop that lets its pending tasks finish before it closes."""

    def close(self) -> None:
        pending = set() if self.is_closed() else asyncio.all_tasks(self)
        if pending and not self.is_running():
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


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
def _draining_event_loops() -> Iterator[None]:
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
