"""Issue 5 claim, measured in one run: with Orbax async saves the loop blocks only for the
device-to-host copy (target: at most 0.10x of a synchronous save). How much slower the steps
that overlap the background write are is reported as information: on a CPU host the writer
shares the cores with the step by nature.

    python benchmarks/checkpoint.py [--config configs/125m.yaml] [--rounds 3] [--steps 10]

Builds the config's model (125m preset: 134M parameters, ~1.6 GB of fp32 state with AdamW) on
the local devices, then measures in the same process:
  sync_s      a synchronous save (`checkpoint.async=false`), start to finished on disk;
  block_s     what each async save blocks the caller for;
  quiet steps step times with no save in flight: `--steps` of them before each round's save
              and after the last one;
  busy steps  the steps that start while an async save is still being written.
A round is one window of quiet steps, then one async save with the steps that overlap it. The
step ratio is the mean busy step over the median quiet step of the whole run; each round's own
ratio is printed too. Every step is the trainer loop's own step (`TrainProgram.stepper`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import _repo_root  # noqa: F401  (before any project import: see its docstring)
import jax

from benchmarks._cli import positive_int, repo_file, run_main
from benchmarks._synthetic import synthetic_batch
from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import CheckpointConfig, load_config
from trainer.models import builder_for_vocab
from trainer.parallel import sharding
from trainer.program import build_program


def batch_for(config, vocab_size: int, sharding_) -> dict:
    return jax.device_put(synthetic_batch(config, vocab_size), sharding_)


def timed_steps(step, state, batch, count: int) -> tuple[object, list[float]]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return state, times


def busy_steps(step, state, batch, background: Checkpointer, limit: int) -> tuple[object, list]:
    """Steps until the background write ends (at most `limit`): only those that start while
    it is still running."""
    times: list[float] = []
    while background.manager.is_saving_in_progress() and len(times) < limit:
        state, more = timed_steps(step, state, batch, 1)
        times += more
    background.wait()
    return state, times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=repo_file("configs/125m.yaml"))
    parser.add_argument("--rounds", type=positive_int, default=3, help="async saves timed")
    parser.add_argument("--steps", type=positive_int, default=10, help="quiet steps per window")
    parser.add_argument(
        "--max-busy",
        type=positive_int,
        default=40,
        help="at most this many steps overlap one write",
    )
    parser.add_argument("--seq-len", type=positive_int, default=128)
    parser.add_argument("--batch", type=positive_int, default=2)
    args = parser.parse_args()
    config = load_config(
        args.config,
        [
            "mesh.data=-1",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            f"data.seq_len={args.seq_len}",
            f"data.global_batch_size={args.batch}",
            "model.remat=none",
        ],
    )
    vocab = config.model.vocab_size or 256
    mesh = sharding.make_mesh(config.mesh)
    program = build_program(config, mesh, builder_for_vocab(config, vocab))
    state = program.init()
    batch = batch_for(config, vocab, program.batch_sharding)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(
        f"{program.num_params / 1e6:.0f}M parameters, {state_bytes / 1e9:.2f} GB of train state, "
        f"devices {jax.devices()}"
    )
    meta = {"param_shapes": param_shapes(state.params)}
    step = program.stepper()  # what the trainer's loop steps with
    quiet: list[list[float]] = []
    busy: list[list[float]] = []
    blocks: list[float] = []
    with jax.set_mesh(mesh), tempfile.TemporaryDirectory() as folder:
        state, _ = timed_steps(step, state, batch, 2)  # compile + warm up
        sync = Checkpointer(f"{folder}/sync", CheckpointConfig(**{"async": False}))
        start = time.perf_counter()
        sync.save(1, state, None, meta)
        sync.wait()
        sync_s = time.perf_counter() - start
        sync.close()

        background = Checkpointer(f"{folder}/async", CheckpointConfig(**{"async": True}))
        background.save(1, state, None, meta)  # the first save pays Orbax's one-time setup
        state, _ = timed_steps(step, state, batch, 1)
        background.wait()
        for round_ in range(args.rounds):
            state, times = timed_steps(step, state, batch, args.steps)
            quiet.append(times)
            blocks.append(background.save(2 + round_, state, None, meta))
            state, times = busy_steps(step, state, batch, background, args.max_busy)
            busy.append(times)
        state, times = timed_steps(step, state, batch, args.steps)
        quiet.append(times)
        background.close()
    report(sync_s, blocks, quiet, busy)


def report(sync_s: float, blocks: list[float], quiet: list[list], busy: list[list]) -> None:
    for number, times in enumerate(busy):
        before, after = quiet[number], quiet[number + 1]
        step_s = statistics.median(before)
        bracket_s = statistics.median(before + after)
        busy_s = statistics.mean(times) if times else float("nan")
        print(
            f"round {number + 1}: quiet {step_s:.3f}s, then {len(times)} busy steps of "
            f"{busy_s:.3f}s ({busy_s / step_s:.2f}x; {busy_s / bracket_s:.2f}x of the quiet "
            "steps before and after); busy steps: " + " ".join(f"{t:.2f}" for t in times)
        )
    all_quiet = [t for times in quiet for t in times]
    all_busy = [t for times in busy for t in times]
    step_s = statistics.median(all_quiet)
    busy_s = statistics.mean(all_busy) if all_busy else float("nan")
    print(
        f"sync save {sync_s:.2f}s; async save blocked {max(blocks):.3f}s at most "
        f"({max(blocks) / sync_s:.3f}x of sync, target <= 0.10x)"
    )
    print(
        f"step {step_s:.3f}s quiet (median of {len(all_quiet)} in {len(quiet)} windows), "
        f"{busy_s:.3f}s while writing (mean of the {len(all_busy)} steps that overlapped "
        f"{len(busy)} writes): {busy_s / step_s:.2f}x (information, no target)"
    )


if __name__ == "__main__":
    sys.exit(run_main(main))
