"""Issue 19 claim: a pipelined step costs what the GPipe bubble says it should.

On S stages with M microbatches a step runs M + S - 1 iterations of which each stage is busy in
M: the idle share is (S-1)/(M+S-1), so against the same model without stages the step should
take 1/(1 - bubble) = (M+S-1)/M as long. Measured here on 4 fake CPU devices for M = S, 2S and
4S at a fixed global batch, beside the unpipelined baseline (mesh.data=4, same devices) in the
same run, in interleaved rounds. On this 2-core CPU the "idle" stages compute the discarded
bubble iterations rather than wait, which costs the same time as the ratio predicts.

    python benchmarks/pipeline.py [--stages 4] [--steps 5] [--rounds 3] [overrides ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _repo_root  # noqa: E402, F401  (before any project import: see its docstring)
import jax  # noqa: E402

from benchmarks._cli import positive_int, run_main  # noqa: E402
from benchmarks._synthetic import synthetic_batch  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.models import builder_for_vocab  # noqa: E402
from trainer.parallel import sharding  # noqa: E402
from trainer.parallel.pipeline import bubble_fraction  # noqa: E402
from trainer.program import build_program  # noqa: E402

VOCAB = 256
DEVICES = 4  # the fake CPU devices every case runs on
MODEL = [
    "model.d_model=128",
    "model.num_heads=4",
    "model.d_ff=512",
    "data.seq_len=64",
    "data.global_batch_size=64",
    "precision.compute=float32",
    "optim.warmup_steps=0",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=positive_int, default=4, help="1, 2 or 4")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model.d_model=512")
    args = parser.parse_args()
    if DEVICES % args.stages:
        parser.error(
            f"argument --stages: {args.stages} does not divide the {DEVICES} devices; use 1, 2 or 4"
        )
    return args


def make_step(stages: int, microbatches: int, layers: int, overrides: list[str]):
    """A compiled step and a state and batch for it; stages=1 is the unpipelined baseline."""
    mesh_keys = [f"mesh.stage={stages}", f"mesh.data={DEVICES // stages}"]
    if stages > 1:
        mesh_keys.append(f"pipeline.microbatches={microbatches}")
    config = load_config(None, [*MODEL, f"model.num_layers={layers}", *mesh_keys, *overrides])
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:DEVICES])
    program = build_program(config, mesh, builder_for_vocab(config, VOCAB))
    batch = synthetic_batch(config, VOCAB)
    with jax.set_mesh(mesh):
        state = program.init()
        batch = jax.device_put(batch, program.batch_sharding)
        state, metrics = program.train_step(state, batch)  # compile
        jax.block_until_ready(metrics)
    return program, [state], batch


def seconds_per_step(program, holder: list, batch, steps: int) -> float:
    with jax.set_mesh(program.mesh):
        start = time.perf_counter()
        for _ in range(steps):
            holder[0], metrics = program.train_step(holder[0], batch)
        jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps


def main() -> None:
    args = parse_args()
    S = args.stages
    cases = {"no stages (data=4)": (1, 0)} | {f"M={m}": (S, m) for m in (S, 2 * S, 4 * S)}
    layers = 2 * S
    built = {name: make_step(s, m, layers, args.overrides) for name, (s, m) in cases.items()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (program, holder, batch) in built.items():
            times[name].append(seconds_per_step(program, holder, batch, args.steps))
    base = statistics.median(times["no stages (data=4)"])
    print(
        f"{layers} layers, {S} stages on 4 fake CPU devices; median of {args.rounds} rounds x "
        f"{args.steps} steps"
    )
    print(f"{'case':<20} {'s/step':>8} {'x base':>7} {'bubble':>7} {'predicted':>9}")
    for name, (stages, m) in cases.items():
        median = statistics.median(times[name])
        bubble = bubble_fraction(stages, m) if stages > 1 else 0.0
        print(
            f"{name:<20} {median:8.3f} {median / base:6.2f}x {bubble:7.1%} {1 / (1 - bubble):8.2f}x"
        )


if __name__ == "__main__":
    sys.exit(run_main(main))
