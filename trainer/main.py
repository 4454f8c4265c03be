"""CLI: `python -m trainer.main --config configs/demo.yaml [key=value ...] [--print-config]`.

Parses, initializes the distributed runtime, and calls `trainer.train.run`. User errors (config,
data, checkpoint mismatch) print one line and exit 2; everything else is a real bug and raises.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from trainer.config import Config, load_config  # noqa: E402
from trainer.errors import USER_ERRORS, exit_now  # noqa: E402

if TYPE_CHECKING:
    from trainer.loop import RunResult

USAGE_EXIT = 2
INTERRUPTED_EXIT = 130  # what a shell reports for a process ended by SIGINT
PEER_LOST_EXIT = 1  # not this process's fault, nor bad input: the run failed
INTERRUPTED = (
    "interrupted without saving; re-run the same command to resume from the latest checkpoint"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.main",
        description="Train a model from a YAML config; overrides are section.key=value.",
    )
    parser.add_argument("--config", default="configs/demo.yaml", help="YAML config file")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, *, ends_process: bool = False) -> int:
    """The run's exit status. `ends_process`: the process ends with it (the CLI), so a stop
    during start-up ends the process at once (see `train`)."""
    args = parse_args(argv)
    dump_stacks_on_sigusr1()
    try:
        config = load_config(args.config, args.overrides)
        if args.print_config:
            print(config.to_yaml(), end="")
            return 0
        summary, stopped = train(config, ends_process)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return end_alone_if_joined(USAGE_EXIT)
    except RuntimeError as err:  # jax.errors.JaxRuntimeError, without importing jax here
        if lost_a_peer(err):
            print(f"error: {peer_lost(err)}", file=sys.stderr)
            return end_alone_if_joined(PEER_LOST_EXIT)
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        print(f"error: {out_of_memory(err)}", file=sys.stderr)
        return end_alone_if_joined(USAGE_EXIT)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the loop: nothing was saved
        # (once the loop has ended with its saves written, Ctrl-C is a `Stopped` that says so)
        quiet_asyncio()
        print(INTERRUPTED, file=sys.stderr)
        return INTERRUPTED_EXIT
    print(summary, file=sys.stderr)
    return config.run.stop_exit_status if stopped else 0


def train(config: Config, ends_process: bool = False) -> tuple[str, bool]:
    """Run `config`; the run's last line (where it finished, or where a SIGTERM outside the step
    loop stopped it), and whether it stopped before `run.steps`, in the loop or outside it."""
    from trainer.parallel.distributed import cluster_from_env, describe, initialize
    from trainer.preemption import OutsideLoop, Stopped  # heavy imports only when training

    cluster = cluster_from_env()
    joining = describe(cluster) if cluster else ""
    outside = OutsideLoop(cluster is None, joining, config.run.stop_exit_status)
    try:
        with outside:
            if cluster is not None:  # before any other JAX call (and before importing the trainer)
                initialize(cluster, joined=outside.runtime_joined)
            from absl import flags

            flags.FLAGS.mark_as_parsed()  # Grain worker processes (data.workers > 0) read them
            from trainer.train import run

            result = run(config)
    # A stop before the first step may have left a compile running on XLA's threads (jax waits
    # for one in a way a signal can leave), and Python's exit then tore the runtime down under
    # it (a segfault): a process that ends with the run ends at once, with the stop's line. What
    # the run opened was closed on the way here, and nothing is saving.
    except Stopped as stop:
        quiet_asyncio()
        if ends_process and not outside.loop_started:
            exit_now(config.run.stop_exit_status, stop.line())
        return stop.line(), True
    except KeyboardInterrupt:
        if ends_process and not outside.loop_started:
            quiet_asyncio()
            exit_now(INTERRUPTED_EXIT, INTERRUPTED)
        raise
    return finished(result, config.run.steps)


def finished(result: RunResult, steps: int) -> tuple[str, bool]:
    """The run's last line: its step, whether it stopped early, and its latest eval_loss, with
    the step it was measured at when that is not the last one (a stop between evals); and
    whether it stopped before `steps`."""
    summary = f"finished at step {result.step}"
    stopped = result.step < steps  # a stop request: the loop saved and said so
    if stopped:
        summary += f" of {steps}: stopped early, re-run the same command to resume"
    if result.eval_loss is not None:
        summary += f"; eval_loss={result.eval_loss:.4f}"
        if result.eval_step is not None and result.eval_step != result.step:
            summary += f" (at step {result.eval_step})"
    return summary, stopped


def lost_a_peer(err: RuntimeError) -> bool:
    """Whether `err` is a collective or a barrier failing because another process is gone (killed,
    its host lost): no bug of this process, whose traceback only buried the first one's line."""
    text = str(err)
    # Gloo's collectives (CPU) read a connection the peer closed ("Connection reset by peer",
    # "Connection closed by peer"); the coordination service misses the peer's heartbeats. (A
    # reset connection alone could be storage's, which is no peer.)
    return ("Gloo" in text and "by peer" in text) or "heartbeat timeout" in text


def peer_lost(err: RuntimeError) -> str:
    """The line of a process whose peer is gone: JAX's error, and where the cause is said."""
    first = str(err).strip().splitlines()[0]
    return (
        f"another process of this run is gone ({first[:200]}); the first to fail says why in its "
        "own log (or was killed: the launcher names it); re-run the same command to resume from "
        "the latest checkpoint"
    )


def end_alone_if_joined(status: int) -> int:
    """`status`; but a process of several that stops on its own error ends now, with it: at a
    normal exit, JAX's shutdown waited for the others (JAX_SHUTDOWN_TIMEOUT_S, 300 s) while they
    waited for it in their next collective, until both aborted with C++ stack traces. Ended, it
    makes their next collective fail at once. The run's own files were closed on the way here."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return status
    exit_now(status)


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr and the run goes on: where
    a run that seems stuck waits (a collective, a save, a peer), without stopping it."""
    stream = sys.__stderr__
    if not hasattr(signal, "SIGUSR1") or stream is None:
        return
    with contextlib.suppress(OSError, ValueError):  # a stderr without a file descriptor
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)


def one_write_per_line() -> None:
    """Each printed line reaches stdout and stderr in one write, even where PYTHONUNBUFFERED is
    set (common in container images), under which `print` writes the text and the newline apart:
    the lines of several processes sharing a terminal (launch/local.sh) or a log then interleave
    mid-line."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def quiet_asyncio() -> None:
    """An interrupt raised inside Orbax's save or restore task would be logged again, with its
    traceback, when asyncio collects that task at exit."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL + 1)


def out_of_memory(err: RuntimeError) -> str:
    """XLA's out-of-memory error as one line: what did not fit, and what shrinks a step."""
    first = str(err).strip().splitlines()[0]
    return (
        f"the step does not fit in device memory ({first[:160]}); lower data.global_batch_size "
        "or data.seq_len (raise optim.accum_steps to keep the batch), set model.remat=full, or "
        "let python -m trainer.plan find a layout that fits"
    )


def end_at_once_on_sigint(status: int) -> None:
    """From here the process only exits, through Python's and JAX's exit-time cleanups: a Ctrl-C
    now ends it at once with `status`, its last line written, where Python's KeyboardInterrupt
    printed a traceback from whichever cleanup it cut."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not one ignored
        signal.signal(signal.SIGINT, lambda _signum, _frame: exit_now(status))


if __name__ == "__main__":
    one_write_per_line()
    exit_status = main(ends_process=True)
    end_at_once_on_sigint(exit_status)
    sys.exit(exit_status)
