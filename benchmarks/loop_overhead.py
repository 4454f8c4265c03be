"""Issue 27 claims: what the training loop costs beyond its step.

1. The loop's own host cost per step (target <= 1 ms), on any machine: the real `Loop` (device
   feed, Grain concat pipeline over the built-in corpus, metrics writer with TensorBoard,
   watchdog, goodput timers, stop requests, the CPU spare-state stepper) around a *null step*, a
   jitted function with the train step's signature, donation, shardings and metrics that does
   almost nothing. Per step between the loop's metrics lines: wall time (what other jobs on the
   machine take shows up here), CPU time of the process, of the loop's thread and of the device
   feed's; beside it, the same null step called in a bare Python loop on batches already on the
   devices (its dispatch alone).
2. The first save against the ones after it (target <= 1.5x), cold and after
   `Checkpointer.warm_up`, each in fresh processes (Orbax sets up once a process).
3. Where an accelerator is present (or with `--real` anywhere), the real loop (`trainer.train.run`)
   against its bare step, the AOT-compiled train step on batches already on the device, at the
   10.8M (6 x 384, 64 x 256), 124M (32 x 1024) and 1B (64 x 2048) shapes (target: the loop at
   least 0.95x as fast as the bare step); and the 5000-step Shakespeare recipe's wall time
   (`--recipe`; target <= 120 s on the H200).
4. `--precision`: XLA's cost analysis of the compiled fp16 and bf16 train steps of 125m.

    python benchmarks/loop_overhead.py [--steps 2000] [--rounds 3] [--shapes 64x256 32x1024]
        [--first-save-width 768] [--real 10.8m 124m 1b] [--real-steps 60] [--recipe]
        [--precision [BxL]]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _repo_root  # noqa: F401  (before any project import: see its docstring)
import jax
import jax.numpy as jnp

from benchmarks._cli import non_negative_int, positive_int, repo_file, run_main
from benchmarks._synthetic import synthetic_batch
from trainer import run
from trainer.checkpoint import Checkpointer
from trainer.config import Config, load_config
from trainer.data import dataset_sources
from trainer.loop import Loop
from trainer.models import builder_for_vocab
from trainer.observe.goodput import Goodput
from trainer.observe.metrics import MetricsWriter, read_metrics
from trainer.parallel import sharding
from trainer.program import TrainProgram, build_program, jit_train_step

# The model whose state the null step carries: the transformer's full tree of leaves (what
# dispatch flattens and donates) at a width where copying it costs nothing.
NULL_MODEL = [
    "model.num_layers=6",
    "model.d_model=16",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.d_ff=32",
]
# The real shapes of issue 27, run by `trainer.train.run` on the built-in corpus.
REAL_SHAPES = {
    "10.8m": (
        repo_file("configs/demo.yaml"),
        [
            "model.num_layers=6",
            "model.num_heads=6",
            "model.num_kv_heads=6",
            "model.d_model=384",
            "model.d_ff=1024",
            "model.dropout=0.2",
            "data.seq_len=256",
            "data.global_batch_size=64",
        ],
    ),
    "124m": (repo_file("configs/125m.yaml"), ["data.seq_len=1024", "data.global_batch_size=32"]),
    "1b": (repo_file("configs/1b.yaml"), ["data.seq_len=2048", "data.global_batch_size=64"]),
    # a CPU-sized stand-in that runs the same code path (the smoke test uses it)
    "tiny": (
        repo_file("configs/demo.yaml"),
        [*NULL_MODEL, "data.seq_len=64", "data.global_batch_size=8"],
    ),
}


@dataclasses.dataclass
class Clocks:
    """Clock readings in seconds: wall, this process's CPU, and the CPU of the loop's thread and
    of the device feed's (Linux; 0 elsewhere)."""

    wall: float
    cpu: float
    main_cpu: float
    feed_cpu: float

    @classmethod
    def now(cls, with_threads: bool = True) -> Clocks:
        """Reading the threads' CPU from /proc takes ~4 ms: only at the ends of a timed span."""
        threads = thread_cpu_s() if with_threads else {}
        return cls(
            time.perf_counter(),
            time.process_time(),
            threads.get("MainThread", 0.0),
            threads.get("device-feed", 0.0),
        )


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's named threads, from /proc (empty where there is none)."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    seconds = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(task.name) in names:  # utime + stime, in clock ticks
            seconds[names[int(task.name)]] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


class TimedWriter(MetricsWriter):
    """The run's real writer, noting when each metrics line (one with a loss) was written; the
    threads' CPU too at the lines of `timed` steps' ends."""

    def __init__(self, *args, timed: tuple[int, int], **kwargs):
        super().__init__(*args, **kwargs)
        self.timed = timed
        self.lines: list[tuple[int, Clocks, float]] = []  # step, clocks, data_wait_frac

    def write(self, step: int, metrics: dict) -> None:
        super().write(step, metrics)
        if "loss" in metrics:
            clocks = Clocks.now(with_threads=step in self.timed)
            self.lines.append((step, clocks, metrics["data_wait_frac"]))


def null_train_step(state, batch):
    """The train step's contract (state in and out, donated; the loop's metrics) and no work."""
    tokens = jnp.sum(batch["weights"])
    one = jnp.float32(1.0)
    metrics = {"loss": one, "grad_norm": one, "lr": one, "tokens": tokens, "params_finite": one}
    return state.replace(step=state.step + 1), metrics


def null_program(config: Config) -> TrainProgram:
    """The real program (state, shardings, eval step) with the null step as its train step."""
    mesh = sharding.make_mesh(config.mesh)
    program = build_program(config, mesh, builder_for_vocab(config, 256))
    train_step = jit_train_step(null_train_step, program.shardings, program.batch_sharding)
    return dataclasses.replace(program, train_step=train_step)


def null_config(workdir: str, batch: int, seq_len: int, steps: int) -> Config:
    return load_config(
        repo_file("configs/demo.yaml"),
        [
            *NULL_MODEL,
            f"run.workdir={workdir}",
            f"run.steps={steps}",
            f"data.global_batch_size={batch}",
            f"data.seq_len={seq_len}",
            f"checkpoint.every={10**9}",
            f"eval.every={10**9}",
        ],
    )


@dataclasses.dataclass
class LoopCost:
    """Per step between the timed metrics lines."""

    wall_s: float
    cpu_s: float  # every thread of the process
    main_cpu_s: float  # the loop's own thread: dispatch, bookkeeping, logging
    feed_cpu_s: float  # the device feed's thread: the host batch and its transfer
    data_wait_frac: float  # of the wall time, waiting for the device feed (the loop's own figure)


def loop_cost(batch: int, seq_len: int, steps: int, warmup: int = 20) -> LoopCost:
    """The real loop around the null step, timed between its metrics lines; the first `warmup`
    steps (compile, feed start) and the last line (the final save and eval) are left out."""
    every = config_log_every()
    steps = -(-steps // every) * every
    timed = (warmup, warmup + steps)  # line steps: multiples of `every`
    with tempfile.TemporaryDirectory() as workdir:
        config = null_config(workdir, batch, seq_len, timed[1] + every)
        program = null_program(config)
        sources = dataset_sources(config.data, seed=config.run.seed)
        writer = TimedWriter(
            workdir, total_steps=config.run.steps, stream=io.StringIO(), timed=timed
        )
        checkpointer = Checkpointer(Path(workdir) / "checkpoints", config.checkpoint)
        loop = Loop(config, sources, program, checkpointer, writer, meta={}, goodput=Goodput())
        with loop, jax.set_mesh(program.mesh):
            loop.train(program.init(), 0)
    lines = [line for line in writer.lines if timed[0] <= line[0] <= timed[1]]
    (first_step, first, _), (last_step, last, _) = lines[0], lines[-1]
    count = last_step - first_step
    assert (first_step, last_step) == timed, "a metrics line of the timed steps is missing"
    return LoopCost(
        wall_s=(last.wall - first.wall) / count,
        cpu_s=(last.cpu - first.cpu) / count,
        main_cpu_s=(last.main_cpu - first.main_cpu) / count,
        feed_cpu_s=(last.feed_cpu - first.feed_cpu) / count,
        data_wait_frac=statistics.mean(wait for _, _, wait in lines[1:]),
    )


def config_log_every() -> int:
    return load_config(repo_file("configs/demo.yaml")).log.every


def bare_seconds_per_step(batch: int, seq_len: int, steps: int) -> tuple[float, float]:
    """Wall and process CPU seconds per step of the same null step, the loop's own stepper, on
    batches already on the devices: the dispatch alone."""
    config = null_config("/tmp/unused", batch, seq_len, steps)
    program = null_program(config)
    host = synthetic_batch(config, 256)
    batches = [jax.device_put(host, program.batch_sharding) for _ in range(4)]
    step = program.stepper()
    with jax.set_mesh(program.mesh):
        state = program.init()
        for i in range(10):
            state, metrics = step(state, batches[i % 4])
        jax.block_until_ready(metrics)
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            state, metrics = step(state, batches[i % 4])
        jax.block_until_ready(metrics)
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def null_step_report(shapes: list[tuple[int, int]], steps: int, rounds: int) -> None:
    for batch, seq_len in shapes:
        loops, bare_rounds = [], []
        for _ in range(rounds):  # interleaved: a busy neighbour slows both alike
            loops.append(loop_cost(batch, seq_len, steps))
            bare_rounds.append(bare_seconds_per_step(batch, seq_len, steps))
        bare_s, bare_cpu = medians(bare_rounds)
        median = {
            name: statistics.median(getattr(c, name) for c in loops)
            for name in ("wall_s", "cpu_s", "main_cpu_s", "feed_cpu_s", "data_wait_frac")
        }
        print(
            f"null step {batch}x{seq_len}: loop {ms(median['wall_s'])} ms/step wall (target <= "
            f"1 ms; rounds {', '.join(ms(c.wall_s) for c in loops)}); CPU ms/step: "
            f"{ms(median['cpu_s'])} in all, {ms(median['main_cpu_s'])} the loop's thread, "
            f"{ms(median['feed_cpu_s'])} the feed's; data_wait_frac "
            f"{median['data_wait_frac']:.2f}; bare step {ms(bare_s)} ms/step wall, "
            f"{ms(bare_cpu)} CPU",
            flush=True,
        )


def medians(rounds: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


# ----------------------------------------------------------------------------- first save


def first_save_blocks(width: int, warm: bool, saves: int = 3) -> list[float]:
    """Seconds each of the first `saves` async saves of a fresh `Checkpointer` blocked, each
    written before the next; with `warm`, after `Checkpointer.warm_up` (written too, as it is
    long before the first save of a run)."""
    config = load_config(
        repo_file("configs/demo.yaml"),
        [
            *NULL_MODEL,
            f"model.d_model={width}",
            f"model.d_ff={width * 8 // 3}",
            "model.num_heads=4",
            "model.num_kv_heads=4",
        ],
    )
    program = build_program(config, sharding.make_mesh(config.mesh), builder_for_vocab(config, 256))
    with jax.set_mesh(program.mesh):
        state = jax.block_until_ready(program.init())
    meta = {"note": "benchmark"}
    blocks = []
    with tempfile.TemporaryDirectory() as workdir:
        checkpointer = Checkpointer(Path(workdir) / "checkpoints", config.checkpoint)
        if warm:
            checkpointer.warm_up(state, meta)
            checkpointer.wait()
        for step in range(1, saves + 1):
            blocks.append(checkpointer.save(step, state, None, meta))
            checkpointer.wait()
        checkpointer.close()
    print(f"state {sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6:.0f} MB")
    return blocks


def first_save_report(width: int, rounds: int) -> None:
    """Each round in fresh processes: what Orbax sets up on first use is set up once a
    process."""
    for warm in (False, True):
        ratios = []
        for _ in range(rounds):
            child = [sys.executable, __file__, "--first-save-child", str(width), str(int(warm))]
            out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            blocks = json.loads(out.strip().splitlines()[-1])
            ratios.append(blocks[0] / max(blocks[1:]))
            size = out.strip().splitlines()[-2]
            print(
                f"first save, {'after warm_up' if warm else 'cold'} ({size}): blocks "
                + ", ".join(f"{b:.3f}" for b in blocks)
                + f" s; first / slowest later {ratios[-1]:.2f}x",
                flush=True,
            )
        print(
            f"first save {'after warm_up' if warm else 'cold'}: median first / slowest later "
            f"{statistics.median(ratios):.2f}x (target <= 1.5x)",
            flush=True,
        )


# ----------------------------------------------------------------------------- real shapes


def real_config(name: str, workdir: str, steps: int, extra: list[str]) -> Config:
    path, overrides = REAL_SHAPES[name]
    return load_config(
        path,
        [
            *overrides,
            *extra,
            "data.path=python-stdlib",
            f"run.workdir={workdir}",
            f"run.steps={steps}",
            f"checkpoint.every={10**9}",
            f"eval.every={10**9}",
            f"log.every={max(1, steps // 6)}",
            "log.progress=false",
        ],
    )


def real_loop_step_s(name: str, steps: int, extra: list[str]) -> float:
    """Median logged step time of `trainer.train.run`, its first two metrics lines (compile)
    and the last (the final save) left out."""
    with tempfile.TemporaryDirectory() as workdir:
        config = real_config(name, workdir, steps, extra)
        run(config)
        rows = read_metrics(Path(workdir) / "metrics.jsonl").rows
    skip = 2 * config.log.every
    times = [r["step_time_s"] for r in rows if "loss" in r and skip < r["step"] < steps]
    return statistics.median(times)


def recipe_wall_s() -> float:
    """Wall time of nanoGPT's Shakespeare GPU recipe in this trainer (`gpu/README.md`): 6 x 384,
    64 x 256, dropout 0.2, 5000 steps, an eval of 50 batches every 500 (nanoGPT: 120 s on the
    H200)."""
    shape = [o for o in REAL_SHAPES["10.8m"][1] if not o.startswith("data.")]
    with tempfile.TemporaryDirectory() as workdir:
        config = load_config(
            repo_file("configs/demo.yaml"),
            [
                *shape,
                "data.seq_len=256",
                "data.global_batch_size=64",
                "optim.lr=1e-3",
                "optim.min_lr=1e-4",
                "optim.warmup_steps=100",
                "optim.b2=0.99",
                "run.steps=5000",
                "eval.every=500",
                "eval.steps=50",
                f"run.workdir={workdir}",
                "log.progress=false",
            ],
        )
        start = time.perf_counter()
        run(config)
        return time.perf_counter() - start


def bare_real_step_s(name: str, steps: int, extra: list[str]) -> float:
    """The AOT-compiled train step on batches already on the device, as `gpu/probe.py` times
    it (through the loop's stepper on CPU, where the loop steps into a spare state)."""
    config = real_config(name, "/tmp/unused", steps, extra)
    vocab = config.model.vocab_size or 256
    mesh = sharding.make_mesh(config.mesh)
    program = build_program(config, mesh, builder_for_vocab(config, vocab))
    batch = jax.device_put(synthetic_batch(config, vocab), program.batch_sharding)
    with jax.set_mesh(mesh):
        state = program.init()
        compiled = program.train_step.lower(state, batch).compile()
        step = program.stepper() if jax.devices()[0].platform == "cpu" else compiled
        for _ in range(3):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps


def real_shapes_report(names: list[str], steps: int, extra: list[str]) -> None:
    for name in names:
        loop_s = real_loop_step_s(name, steps, extra)
        bare_s = bare_real_step_s(name, max(10, steps // 4), extra)
        print(
            f"real {name}: loop {loop_s * 1e3:.1f} ms/step, bare step {bare_s * 1e3:.1f} ms/step: "
            f"the loop runs at {bare_s / loop_s:.3f}x the bare step's speed (target >= 0.95x)",
            flush=True,
        )


# ----------------------------------------------------------------------------- fp16 vs bf16


def step_cost(compute: str, batch: int, seq_len: int) -> dict[str, float]:
    """XLA's cost analysis of the compiled train step of configs/125m.yaml on this backend:
    bytes accessed, flops, and how many fusions (kernels, on a GPU) it runs."""
    config = load_config(
        repo_file("configs/125m.yaml"),
        [
            "mesh.data=-1",
            "mesh.fsdp=1",
            f"data.seq_len={seq_len}",
            f"data.global_batch_size={batch}",
            f"precision.compute={compute}",
        ],
    )
    program = build_program(
        config, sharding.make_mesh(config.mesh), builder_for_vocab(config, 32000)
    )
    batch_shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=program.batch_sharding),
        synthetic_batch(config, 256),
    )
    with jax.set_mesh(program.mesh):
        compiled = program.train_step.lower(program.abstract_state(), batch_shapes).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    fusions = compiled.as_text().count(" fusion(")
    return {"bytes": cost["bytes accessed"], "flops": cost["flops"], "fusions": fusions}


def precision_report(batch: int, seq_len: int) -> None:
    costs = {compute: step_cost(compute, batch, seq_len) for compute in ("bfloat16", "float16")}
    bf16, fp16 = costs["bfloat16"], costs["float16"]
    print(
        f"train step 125m at {batch}x{seq_len} ({jax.devices()[0].platform}): bytes accessed "
        f"fp16/bf16 {fp16['bytes'] / bf16['bytes']:.3f}x ({fp16['bytes'] / 1e9:.2f} vs "
        f"{bf16['bytes'] / 1e9:.2f} GB), flops {fp16['flops'] / bf16['flops']:.3f}x, fusions "
        f"{fp16['fusions']} vs {bf16['fusions']}",
        flush=True,
    )


def shape(text: str) -> tuple[int, int]:
    """An argparse type: `BxL`, a batch and a sequence length of one at least."""
    batch, _, seq_len = text.partition("x")
    return positive_int(batch), positive_int(seq_len)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--steps", type=positive_int, default=2000, help="timed null steps per round"
    )
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument(
        "--shapes", nargs="*", type=shape, default=[(64, 256), (32, 1024)], help="BxL null steps"
    )
    parser.add_argument(
        "--first-save-width",
        type=non_negative_int,
        default=768,
        help="model width of the first-save state (768: ~500 MB); 0 skips that part",
    )
    parser.add_argument(
        "--real",
        nargs="*",
        choices=sorted(REAL_SHAPES),
        help="real-loop shapes to time against their bare step (default on an accelerator: "
        "10.8m 124m 1b; none on CPU)",
    )
    parser.add_argument("--real-steps", type=positive_int, default=60)
    parser.add_argument("--set", nargs="*", default=[], help="overrides for the real shapes")
    parser.add_argument(
        "--recipe", action="store_true", help="the 5000-step Shakespeare recipe's wall time"
    )
    parser.add_argument(
        "--precision",
        nargs="?",
        const=(2, 128),
        type=shape,
        help="compare the compiled fp16 and bf16 train steps of 125m (XLA's cost analysis) at "
        "BxL (default 2x128)",
    )
    parser.add_argument("--first-save-child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_save_child:
        width, warm = args.first_save_child
        print(json.dumps(first_save_blocks(width, bool(warm))))
        return
    print(f"devices: {jax.devices()}", flush=True)
    if args.precision:
        precision_report(*args.precision)
    null_step_report(args.shapes, args.steps, args.rounds)
    if args.first_save_width:
        first_save_report(args.first_save_width, max(1, args.rounds - 1))
    accelerator = jax.devices()[0].platform != "cpu"
    names = args.real if args.real is not None else (["10.8m", "124m", "1b"] if accelerator else [])
    real_shapes_report(names, args.real_steps, args.set)
    if args.recipe or (accelerator and args.real is None):
        print(f"Shakespeare recipe: {recipe_wall_s():.1f} s wall (target <= 120 s)", flush=True)


if __name__ == "__main__":
    sys.exit(run_main(main))
