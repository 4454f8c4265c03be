"""The step loop: dispatch step t, then read the metrics of the earlier steps that have finished, so
the host never blocks on the device for bookkeeping and up to `IN_FLIGHT` steps stay queued on
it. One step call on every backend; checkpoints, evals, stop requests and the goodput timing sit
around it. Batches arrive already on the devices.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from input_pipeline.device import DeviceFeed
from trainer.checkpoint import Checkpointer
from trainer.config import Config, DataConfig
from trainer.data import DataSources
from trainer.errors import ConfigError, TrainingError
from trainer.nonfinite import NonFiniteStop, checked_vocab_size
from trainer.observe.goodput import Goodput, format_summary, session_summary, write_summary
from trainer.observe.metrics import MetricsWriter, last_logged
from trainer.observe.profiling import ProfileWindow
from trainer.observe.watchdog import Watchdog
from trainer.parallel.state import TrainState
from trainer.preemption import StopRequest
from trainer.program import StepMetrics, TrainProgram
from trainer.step import ROW_METRICS, Batch

# Steps whose metrics may stay unread after a dispatch: the device runs them while the host
# prepares the next one. A step's metrics are read once it has finished, or when more than this
# many are pending (then the host waits for the oldest: the device is that far ahead).
IN_FLIGHT = 2


@dataclass
class RunResult:
    """What `run` hands back: the final state and the last logged numbers."""

    state: TrainState
    step: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    eval_loss: float | None = None
    eval_step: int | None = None  # the step `eval_loss` was measured at


@dataclass
class StepRecord:
    """One dispatched step, its metrics still on the device until `Loop._record` reads them."""

    step: int
    metrics: StepMetrics
    wait_s: float  # wall time waiting for its batch
    data_state: Any = None  # the data position after its batch (per-source token counts)
    batch: Batch | None = None  # its arrays, already on the devices: checked if its loss is NaN


@dataclass
class LogWindow:
    """The steps since the last metrics line: a line reports their means, not one sampled step."""

    steps: int = 0
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    wait_s: float = 0.0
    tokens: float = 0.0  # what the loss averaged over: tokens without padding, or examples
    aux: dict[str, list[float]] = field(default_factory=dict)  # loss_fn's other aux scalars

    def add(self, record: StepRecord, metrics: dict[str, float], seconds: float) -> None:
        self.steps += 1
        _add_finite(self.losses, metrics["loss"])
        self.seconds += seconds
        self.wait_s += record.wait_s
        self.tokens += metrics["tokens"]
        for name, value in metrics.items():
            if name not in ROW_METRICS:  # the step's own metrics are not the loss's aux
                _add_finite(self.aux.setdefault(name, []), value)

    def means(self) -> dict[str, float]:
        seconds = max(self.seconds, 1e-12)
        return {
            "loss": _finite_mean(self.losses),
            "tokens_per_s": self.tokens / seconds,
            "step_time_s": self.seconds / max(self.steps, 1),
            "data_wait_frac": min(self.wait_s / seconds, 1.0),
            **{name: _finite_mean(values) for name, values in self.aux.items()},
        }


def check_mixture_eval_names(names: list[str], sources: list[str]) -> None:
    """A mixture's eval logs `eval_<name>` and `eval_<name>_<source>`: an aux `acc_code` beside
    an aux `acc` and a source `code` would both be `eval_acc_code`, one value silently lost."""
    meanings: dict[str, str] = {}
    for name in names:
        meanings[f"eval_{name}"] = f"aux {name!r}"
    for name in names:
        for source in sources:
            key, meaning = f"eval_{name}_{source}", f"aux {name!r} on mixture source {source!r}"
            if (other := meanings.setdefault(key, meaning)) != meaning:
                raise ConfigError(
                    f"loss_fn's {meaning} and {other} would both log in eval as {key!r}; "
                    "rename one of the two aux in loss_fn (or the source: data.mixture[].name)"
                )


def check_mixture_eval_step(data: DataConfig, program: TrainProgram, sources: DataSources) -> None:
    """`check_mixture_eval_names` at setup, not hours later at the first eval: the names are the
    eval step's own aux (a loss_fn's train aux may differ), read from its output's shapes on an
    abstract state and batch (nothing is read or computed). Free without a mixture's evals."""
    if not sources.make_evals:
        return
    batch = program.abstract_batch(data.global_batch_size, data.seq_len)
    with jax.set_mesh(program.mesh):
        out = jax.eval_shape(program.eval_step, program.abstract_state(), batch)
    check_mixture_eval_names(["loss", *out["aux_sums"]], list(sources.make_evals))


def _add_finite(values: list[float], value: float) -> None:
    """A window's mean skips non-finite steps (skipped ones, with optim.skip_nonfinite)."""
    if np.isfinite(value):
        values.append(value)


def _finite_mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


@dataclass
class Progress:
    """What the loop counts while it runs: the one part of it that changes."""

    result: RunResult
    watchdog: Watchdog  # a stuck step ends the process; beaten by every step read
    skipped_steps: int = 0  # non-finite steps skipped so far (optim.skip_nonfinite)
    tokens_seen: float = 0.0  # this session's, for the summary's throughput
    window: LogWindow = field(default_factory=LogWindow)  # steps since the last metrics line
    # the newest step's metrics and data position, while no line reports it yet
    unlogged: tuple[dict[str, float], Any] | None = None
    # when the last step's metrics were read, or work that is no step (an eval, a save) ended:
    # a step's time is from there to the read of its own metrics (see `Loop._record`)
    clock: float = field(default_factory=time.perf_counter)


@dataclass
class Session:
    """One `train` call's step loop: what its steps use, and the locals they share."""

    progress: Progress
    stop: StopRequest
    feed: DeviceFeed
    profile: ProfileWindow
    train_step: Callable[[TrainState, Batch], tuple[TrainState, StepMetrics]]
    timing: Callable[[str], Any]  # Goodput.timing and Watchdog.phase, bound once, not per step
    watch: Callable[..., Any]
    state: TrainState  # after the newest step dispatched
    saved: int  # the newest step with a checkpoint (or none, at 0)
    data_state: Any = None  # the data position after the last step's batch
    pending: deque[StepRecord] = field(default_factory=deque)  # dispatched, not read (oldest 1st)


@dataclass
class Loop:
    """The step loop's settings and the run's resources; closes the checkpointer and the writer
    on exit, so that `run` is its setup calls and `with Loop(...) as loop: loop.train(...)`."""

    config: Config
    sources: DataSources
    program: TrainProgram
    checkpointer: Checkpointer
    writer: MetricsWriter
    meta: dict[str, Any]
    flops_per_token: float = 0.0
    peak_tflops: float | None = None  # per device; None when the device kind is unknown
    goodput: Goodput = field(default_factory=Goodput)  # where the wall time goes
    sampler: Callable[[int, TrainState], None] | None = None  # eval.sample_prompts
    nonfinite: NonFiniteStop = field(init=False)  # what a NaN/Inf step stops the run with

    def __post_init__(self) -> None:
        vocab = self.meta.get("vocab_size")  # the run's: model.vocab_size or the dataset's
        if vocab:
            shapes = self.meta.get("param_shapes", {})
            vocab = checked_vocab_size(vocab, self.program.skeleton.param_specs, shapes)
        self.nonfinite = NonFiniteStop(
            self.config.optim.skip_nonfinite, self.config.precision.loss_scale_min, vocab or None
        )

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.checkpointer.close()
        finally:
            self.writer.close()

    def train(self, state: TrainState, start_step: int) -> RunResult:
        """Train from `start_step` to `run.steps` (or a stop request); wait for the saves still
        being written, and write this session's summary when it trained a step."""
        result = RunResult(state=state, step=start_step)
        if start_step >= self.config.run.steps:
            self.writer.message(
                f"run already at step {start_step} >= run.steps={self.config.run.steps}; raise "
                "run.steps to train further"
            )
            return result
        progress = Progress(result, Watchdog(self.config.run.step_timeout_s))
        if start_step:  # a running total: the steps earlier sessions skipped count too
            progress.skipped_steps = int(last_logged(self.config.run.workdir, "skipped_steps") or 0)
        with StopRequest() as stop:  # held over the last wait too: a SIGTERM must not cut a save
            self._steps(state, start_step, progress, stop)
            with self.goodput.timing("checkpoint"):
                self.checkpointer.wait()  # saves still being written hold up the end of the run
        if jax.process_index() == 0 and result.step > start_step:  # else the last one stays
            summary = session_summary(
                self.goodput,
                start_step=start_step,
                end_step=result.step,
                tokens=progress.tokens_seen,
                flops_per_token=self.flops_per_token,
                peak_tflops=self.peak_tflops,
                last_metrics=result.last_metrics,
                eval_loss=result.eval_loss,
            )
            self.writer.message(format_summary(summary))
            if problem := write_summary(Path(self.config.run.workdir), summary):
                self.writer.message(problem)
        return result

    def _steps(
        self, state: TrainState, start_step: int, progress: Progress, stop: StopRequest
    ) -> None:
        """Steps `start_step + 1` to `run.steps`, or to a stop request: then, once its save is
        written, the line that says where it is."""
        config, total = self.config, self.config.run.steps
        feed = self._feed(self.sources.train)
        profile = ProfileWindow(Path(config.run.workdir) / "profile", config.log.profile_steps)
        timing, watch = self.goodput.timing, progress.watchdog.phase
        session = Session(
            progress, stop, feed, profile, self.program.stepper(), timing, watch, state, start_step
        )
        with feed, profile, progress.watchdog:
            if total - start_step > config.checkpoint.every:  # a save before the last step
                with timing("checkpoint"), watch("checkpoint"):
                    self.checkpointer.warm_up(state, self.meta)
            progress.clock = time.perf_counter()
            for step in range(start_step + 1, total + 1):
                batch = self._next_batch(session, step)
                if batch is None:  # a stop while waiting for data: at the last completed step
                    step -= 1
                    self._stop_between_steps(session, step)
                    break
                self._dispatch(session, step, batch)
                saving = stop.at_step() or step % config.checkpoint.every == 0 or step == total
                evaluating = step % config.eval.every == 0 or step == total
                if (saving or evaluating) and self._save_or_eval(session, step, saving, evaluating):
                    break  # a stop request (it always saves the step): this step was the last
        progress.result.state, progress.result.step = session.state, step
        if stop.requested:
            with timing("checkpoint"):
                self.checkpointer.wait()
            self.writer.message(self._stop_line(stop.signal_name, step))

    def _feed(self, batches: Iterator[Batch]) -> DeviceFeed:
        """`batches` put on the devices by a thread, `data.prefetch` ahead of the loop."""
        sharding, prefetch = self.program.batch_sharding, self.config.data.prefetch
        return DeviceFeed(batches, sharding, prefetch, self.sources.feeders)

    def _next_batch(self, session: Session, step: int) -> Batch | None:
        """Wait for the batch of `step` (its data position goes to `session.data_state`); None
        when a stop request ended the wait."""
        if session.pending and not session.feed.ready():
            # The device runs out of queued steps before the next batch comes: read them now,
            # so the lines (and the watchdog's last completed step) are current.
            with session.timing("step"), session.watch("step"):
                self._read_finished(session.pending, session.progress, keep=0)
        try:
            with session.timing("data_wait"), session.watch("data", step):
                fetched = session.feed.next_unless(session.stop.at_wait)
        except StopIteration:
            raise TrainingError(
                f"the training data ran out before step {step}; repeat it (e.g. grain's "
                ".repeat()) or lower run.steps"
            ) from None
        if fetched is None:
            return None
        batch, session.data_state = fetched
        return batch

    def _dispatch(self, session: Session, step: int, batch: Batch) -> None:
        """Queue `step` on the device and, while it runs, read the earlier steps that have
        finished (and the oldest anyway, until at most `IN_FLIGHT` are unread)."""
        session.profile.before_step(step, session.state)
        with session.timing("step"), session.watch("step"):
            session.state, metrics = session.train_step(session.state, batch)
            metrics.start_copy()
            self._read_finished(session.pending, session.progress, keep=IN_FLIGHT - 1)
        session.profile.after_step(step, metrics)
        wait_s = session.feed.last_wait_s
        session.pending.append(StepRecord(step, metrics, wait_s, session.data_state, batch))

    def _save_or_eval(self, session: Session, step: int, saving: bool, evaluating: bool) -> bool:
        """After a step that saves or evaluates: read every step, evaluate, save; True when a
        stop request ends the loop at `step`."""
        stop, timing, watch = session.stop, session.timing, session.watch
        # Read all now: never save a NaN; this step's line is on disk before its checkpoint can
        # become the resume point (a resume truncates lines after it), and before an eval's line.
        with timing("step"), watch("step"):  # waiting for its result: step time
            self._read_finished(session.pending, session.progress, keep=0, last=stop.requested)
        if evaluating and self.sources.make_eval is not None:
            # a stop decided at this step lets its eval finish; one during it ends it
            stopped = (lambda: False) if stop.requested else stop.at_wait
            with timing("eval"), watch("eval"):
                eval_row = self._eval_metrics(session.state, stopped)
            if eval_row is not None:
                result = session.progress.result
                result.eval_loss, result.eval_step = eval_row["eval_loss"], step
                self.writer.write(step, eval_row)
            else:  # a stop came while it waited for eval data: this step is the last
                self._write_unlogged_line(step, session.progress)
                saving = True
        if evaluating and self.sampler is not None:
            with timing("eval"), watch("eval"):
                self.sampler(step, session.state)
        if saving:
            if stop.requested:  # the run's last save: a second SIGINT lets it finish
                stop.saving_last(step)
            self._save(session, step)
        session.progress.clock = time.perf_counter()  # every step was read: the next starts now
        if stop.requested:
            session.feed.give_up()  # its read under way, which may never return, is not waited for
        return stop.requested

    def _save(self, session: Session, step: int) -> None:
        """Checkpoint `step`: its state and the data position after its batch."""
        with session.timing("checkpoint"), session.watch("checkpoint"):
            blocked = self.checkpointer.save(step, session.state, session.data_state, self.meta)
        self.writer.write(step, {"ckpt_block_s": blocked})
        session.saved = step

    def _stop_between_steps(self, session: Session, step: int) -> None:
        """A stop while waiting for the batch after `step`, the last completed one: its line
        and, unless it has one, its checkpoint, as a stop after a step writes them."""
        if step > session.saved:  # its save is the run's last: a second SIGINT lets it finish
            session.stop.saving_last(step)
        with session.timing("step"), session.watch("step"):  # all of them: never save a NaN
            self._read_finished(session.pending, session.progress, keep=0, last=True)
        self._write_unlogged_line(step, session.progress)
        if step > session.saved:
            self._save(session, step)

    def _write_unlogged_line(self, step: int, progress: Progress) -> None:
        """At a stop between `log.every` lines: the line of the steps up to `step`, as a stop
        after a step writes it."""
        if progress.unlogged is not None:
            self._write_line(step, progress)

    def _stop_line(self, signal_name: str | None, step: int) -> str:
        """What a stop says: where its checkpoint is, or that it trained nothing to save."""
        if step == 0:
            return (
                f"stopped by {signal_name} before step 1; nothing was trained, so nothing is "
                "saved; re-run the same command to start"
            )
        return (
            f"stopped by {signal_name} at step {step}; checkpoint saved in "
            f"{self.checkpointer.directory / str(step)}; re-run the same command to resume"
        )

    def _eval_metrics(
        self, state: TrainState, stopped: Callable[[], bool]
    ) -> dict[str, float] | None:
        """`eval_loss`, and `eval_<name>` for each of the loss's other aux scalars; for a
        mixture also each source's `eval_loss_<source>` (`eval_<name>_<source>`), and as
        `eval_loss` (`eval_<name>`) the mixture's expectation: the sources' values weighted by
        their mixture weights. None when `stopped()` turned true during the eval."""
        if not self.sources.make_evals:
            means = self._eval_means(self.sources.make_eval, state, stopped)
            return None if means is None else {f"eval_{k}": v for k, v in means.items()}
        by_source = {}
        for source, (_, make) in self.sources.make_evals.items():
            if (means := self._eval_means(make, state, stopped)) is None:
                return None
            by_source[source] = means
        weights = {source: weight for source, (weight, _) in self.sources.make_evals.items()}
        total = sum(weights.values())
        names = list(next(iter(by_source.values())))  # checked at setup: `check_mixture_eval_step`
        row = {
            f"eval_{k}": sum(by_source[s][k] * w for s, w in weights.items()) / total for k in names
        }
        for source, means in by_source.items():
            row.update({f"eval_{k}_{source}": v for k, v in means.items()})
        return row

    def _eval_means(
        self,
        make_eval: Callable[[], Iterable[Batch]],
        state: TrainState,
        stopped: Callable[[], bool],
    ) -> dict[str, float] | None:
        """Mean held-out `loss` (per token, or per the loss's `weight`) over `eval.steps`
        batches, and its other aux scalars averaged the same way; None when `stopped()` turned
        true during it: between batches, or while waiting for one."""
        sums, weight = {}, 0.0
        feed = self._feed(iter(make_eval()))
        with feed:
            for _ in range(self.config.eval.steps):
                if stopped():  # a long eval of ready batches must not outlast a SIGTERM's grace
                    feed.give_up()  # as a stopped wait does: its thread may be stuck in the source
                    return None
                try:
                    fetched = feed.next_unless(stopped)
                except StopIteration:  # finite eval data: all of it
                    break
                if fetched is None:
                    return None
                out = jax.device_get(self.program.eval_step(state, fetched[0]))
                for name, value in {"loss": out["loss_sum"], **out["aux_sums"]}.items():
                    sums[name] = sums.get(name, 0.0) + float(value)
                weight += float(out["weight"])
        if weight == 0:
            raise ConfigError(
                f"the eval data of {self.sources.description} yields no batch; lower "
                "data.global_batch_size or data.seq_len, or pass more eval data"
            )
        return {name: value / weight for name, value in sums.items()}

    def _read_finished(
        self, pending: deque[StepRecord], progress: Progress, keep: int, last: bool = False
    ) -> None:
        """Read the pending steps in order while they have finished, and the oldest ones anyway
        until at most `keep` remain; `last` marks the final one read as the run's last."""
        while pending and (len(pending) > keep or pending[0].metrics.is_ready()):
            record = pending.popleft()
            self._record(record, progress, last=last and not pending)

    def _record(self, record: StepRecord, progress: Progress, last: bool = False) -> None:
        """Read one finished step's metrics; check them; write a line every `log.every` steps,
        at the run's last step, and at a stop (`last`)."""
        step = record.step
        metrics = record.metrics.read()
        # Timed from read to read, not from dispatch to dispatch: dispatch returns before the
        # device runs the step, so a step dispatched into an idle queue (after the compile, an
        # eval or a save) took no time, and the one that waited for it took two.
        now = time.perf_counter()
        seconds, progress.clock = now - progress.clock, now
        progress.watchdog.beat(step)
        self.nonfinite.check(step, metrics, record.batch)
        progress.skipped_steps += int(metrics.get("skipped", 0.0))
        progress.tokens_seen += metrics["tokens"]
        progress.window.add(record, metrics, seconds)
        progress.unlogged = metrics, record.data_state
        if step % self.config.log.every and step != self.config.run.steps and not last:
            return
        self._write_line(step, progress)

    def _write_line(self, step: int, progress: Progress) -> None:
        """The metrics line of the steps since the last one, ending at `step` (whose metrics
        and data position are `progress.unlogged`)."""
        (metrics, data_state), progress.unlogged = progress.unlogged, None
        row = {**progress.window.means(), "lr": metrics["lr"], "grad_norm": metrics["grad_norm"]}
        tflops = row["tokens_per_s"] * self.flops_per_token / jax.device_count() / 1e12
        row["tflops_per_device"] = tflops
        if self.peak_tflops:
            row["mfu"] = tflops / self.peak_tflops
        if "loss_scale" in metrics:
            row["loss_scale"] = metrics["loss_scale"]
        if "skipped" in metrics:
            row["skipped_steps"] = progress.skipped_steps
        if self.config.data.skip_corrupt and self.sources.skipped_records is not None:
            row["corrupt_records_skipped"] = self.sources.skipped_records()
        if self.sources.source_tokens is not None:
            row.update(self.sources.source_tokens(data_state))
        row.update(self.goodput.metrics())
        self.writer.write(step, row)
        progress.result.last_metrics = row
        progress.window = LogWindow()  # the next line averages the steps after this one
