"""Issue 4 and 17 claims, measured in one run on this machine:

1. compile time of the train step at 4 vs 32 layers (the layer scan keeps the ratio near 1);
2. steady step time of the real trainer loop (`trainer.train.run`: Grain data, device feed,
   metrics every step, checkpoints off the hot path) vs a bare loop that calls the same step
   (`TrainProgram.stepper`: same step function, same buffer strategy) on batches already on the
   devices, so the ratio is the loop's own overhead (target <= 1.05x);
3. the bare loop again with the donating in-place step, beside the loop's step (on CPU: into a
   spare state), to show which buffer strategy is faster here;
4. with `--against DIR` (a checkout of another commit), the trainer loop's step time of that
   checkout beside this one's, in interleaved rounds (target: at most 1.05x slower here).

    python benchmarks/train_step.py [--steps 60] [--rounds 3] [--configs A.yaml B.yaml]
                                    [--against /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _repo_root  # noqa: F401  (before any project import: see its docstring)
import jax

from benchmarks._cli import positive_int, repo_file, run_main
from benchmarks._synthetic import synthetic_batch
from trainer import run
from trainer.config import Config, load_config
from trainer.data import dataset_sources, load_dataset
from trainer.models import build_model
from trainer.observe.metrics import read_metrics
from trainer.parallel import sharding
from trainer.program import build_program


def builder(config: Config, vocab_size: int):
    return functools.partial(
        build_model,
        config.model,
        vocab_size=vocab_size,
        compute_dtype=config.precision.compute,
        param_dtype=config.precision.params,
    )


def compile_seconds(config_path: str, num_layers: int) -> float:
    # the claim is the scan's: compile time flat in depth (`model.scan_layers=false` grows)
    config = load_config(config_path, [f"model.num_layers={num_layers}", "model.scan_layers=true"])
    mesh = sharding.make_mesh(config.mesh)
    program = build_program(config, mesh, builder(config, 256))
    state = program.abstract_state()
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=program.batch_sharding),
        synthetic_batch(config, 256),
    )
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        program.train_step.lower(state, batch).compile()
    return time.perf_counter() - start


def bare_step_seconds(
    config: Config, vocab_size: int, batches: list[dict], steps: int, in_place: bool = False
) -> float:
    """The baseline: the trainer's own step on pre-placed batches, in the shortest loop; with
    `in_place`, the donating step instead of the loop's (which on CPU steps into a spare)."""
    mesh = sharding.make_mesh(config.mesh)
    program = build_program(config, mesh, builder(config, vocab_size))
    step = program.train_step if in_place else program.stepper()
    device_batches = [jax.device_put(b, program.batch_sharding) for b in batches]
    with jax.set_mesh(mesh):
        state = program.init()
        state, metrics = step(state, device_batches[0])
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for i in range(steps):
            state, metrics = step(state, device_batches[i % len(device_batches)])
        jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps


def trainer_step_seconds(config_path: str, steps: int) -> tuple[float, float, Config]:
    """Median logged step time of a real run (first 10 steps, which include compile, skipped);
    every step is logged, so each line's mean is one step."""
    with tempfile.TemporaryDirectory() as workdir:
        config = load_config(
            config_path,
            [
                f"run.workdir={workdir}",
                f"run.steps={steps + 10}",
                "log.every=1",
                f"eval.every={10**6}",
                f"checkpoint.every={10**6}",
                "log.progress=false",
                "log.tensorboard=false",
            ],
        )
        run(config)
        rows = read_metrics(Path(workdir) / "metrics.jsonl").rows
    times = [r["step_time_s"] for r in rows if "loss" in r and r["step"] > 10]
    waits = [r["data_wait_frac"] for r in rows if "loss" in r and r["step"] > 10]
    return statistics.median(times), max(waits), config


def other_checkout_step_seconds(checkout: str, config_path: str, steps: int) -> float:
    """`trainer_step_seconds` of another checkout's code, in a fresh process (its own imports)."""
    script = (
        "import sys; sys.path[:0] = ['.', 'benchmarks']; import train_step; "
        f"print(train_step.trainer_step_seconds({str(Path(config_path).resolve())!r}, {steps})[0])"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=checkout, capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=positive_int, default=60)
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="trainer/bare pairs per config"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=[repo_file("configs/demo.yaml"), repo_file("configs/nanogpt_cpu.yaml")],
    )
    parser.add_argument("--against", help="another checkout whose trainer step to time alongside")
    args = parser.parse_args()
    if args.against and not (Path(args.against) / "benchmarks/train_step.py").is_file():
        parser.error(
            f"argument --against: {args.against} has no benchmarks/train_step.py; give a "
            "checkout of this project (git worktree add DIR COMMIT)"
        )
    print(f"devices: {jax.devices()}")
    c4, c32 = compile_seconds(args.configs[0], 4), compile_seconds(args.configs[0], 32)
    print(
        f"compile time, {args.configs[0]}: 4 layers {c4:.2f}s, 32 layers {c32:.2f}s, "
        f"ratio {c32 / c4:.2f}x"
    )
    for path in args.configs:
        trainer_times, bare_times, in_place_times, other_times, waits = [], [], [], [], []
        for _ in range(args.rounds):  # interleaved: a busy neighbour slows every side alike
            trainer_s, max_wait, config = trainer_step_seconds(path, args.steps)
            info = load_dataset(config.data)
            host = dataset_sources(config.data, seed=config.run.seed).train
            batches = [next(host) for _ in range(8)]
            bare_times.append(bare_step_seconds(config, info.vocab_size, batches, args.steps))
            in_place_times.append(
                bare_step_seconds(config, info.vocab_size, batches, args.steps, in_place=True)
            )
            trainer_times.append(trainer_s)
            waits.append(max_wait)
            if args.against:
                other_times.append(other_checkout_step_seconds(args.against, path, args.steps))
        ratios = [t / b for t, b in zip(trainer_times, bare_times, strict=True)]
        trainer_s, bare_s = statistics.median(trainer_times), statistics.median(bare_times)
        tokens = config.data.global_batch_size * config.data.seq_len
        print(
            f"{path}: trainer {trainer_s * 1e3:.1f} ms/step ({tokens / trainer_s:,.0f} tokens/s, "
            f"max data_wait_frac {max(waits):.3f}); bare loop {bare_s * 1e3:.1f} ms/step; "
            f"ratio median {statistics.median(ratios):.3f}x over {args.rounds} rounds "
            f"({', '.join(f'{r:.3f}' for r in ratios)})"
        )
        in_place_s = statistics.median(in_place_times)
        print(
            f"{path}: bare loop stepping in place {in_place_s * 1e3:.1f} ms/step vs the loop's "
            f"step {bare_s * 1e3:.1f} ms/step: {bare_s / in_place_s:.3f}x (rounds: "
            + ", ".join(
                f"{b * 1e3:.1f} vs {i * 1e3:.1f}"
                for b, i in zip(bare_times, in_place_times, strict=True)
            )
            + ")"
        )
        if other_times:
            other_s = statistics.median(other_times)
            print(
                f"{path}: {args.against} trainer {other_s * 1e3:.1f} ms/step; this checkout "
                f"{trainer_s * 1e3:.1f} ms/step: {trainer_s / other_s:.3f}x (rounds: "
                + ", ".join(
                    f"{t * 1e3:.1f} vs {o * 1e3:.1f}"
                    for t, o in zip(trainer_times, other_times, strict=True)
                )
                + ")"
            )


if __name__ == "__main__":
    sys.exit(run_main(main))
