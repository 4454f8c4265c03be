"""Issue 4 claims, measured in one run on this machine:

1. compile time of the train step at 4 vs 32 layers (the layer scan keeps the ratio near 1);
2. steady step time of the real trainer loop (`trainer.train.run`: Grain data, device feed,
   metrics, checkpoints off the hot path) vs a bare `jax.jit` loop over the same model and
   optimizer on pre-made device batches (target <= 1.05x);
3. tokens/s of the trainer for the given configs.

    python benchmarks/train_step.py [--steps 60] [--rounds 3] [--configs A.yaml B.yaml]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import _repo_root  # noqa: F401  (before any project import: see its docstring)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from trainer import sharding
from trainer.config import Config, load_config
from trainer.data import lm_batches, load_dataset
from trainer.models import build_model
from trainer.program import build_program
from trainer.train import run


def builder(config: Config, vocab_size: int):
    return functools.partial(
        build_model,
        config.model,
        vocab_size=vocab_size,
        compute_dtype=config.precision.compute,
        param_dtype=config.precision.params,
    )


def synthetic_batch(config: Config, vocab_size: int) -> dict[str, np.ndarray]:
    B, L = config.data.global_batch_size, config.data.seq_len
    tokens = np.random.default_rng(0).integers(0, vocab_size, (B, L + 1)).astype(np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.ones((B, L), np.int32),
        "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
        "weights": np.ones((B, L), np.float32),
    }


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


def bare_step_seconds(config: Config, vocab_size: int, batches: list[dict], steps: int) -> float:
    """The baseline: the same model and AdamW in the shortest jitted loop one could write."""
    model = builder(config, vocab_size)(rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(batch).astype(jnp.float32)
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)
            return jnp.mean(nll)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    device_batches = [jax.device_put(b) for b in batches]
    params, opt_state, loss = step(params, opt_state, device_batches[0])
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, device_batches[i % len(device_batches)])
    jax.block_until_ready(loss)
    return (time.perf_counter() - start) / steps


def trainer_step_seconds(config_path: str, steps: int) -> tuple[float, float, Config]:
    """Median logged step time of a real run (first 10 steps, which include compile, skipped)."""
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
        rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").open()]
    times = [r["step_time_s"] for r in rows if "loss" in r and r["step"] > 10]
    waits = [r["data_wait_frac"] for r in rows if "loss" in r and r["step"] > 10]
    return statistics.median(times), max(waits), config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3, help="trainer/bare pairs per config")
    parser.add_argument(
        "--configs", nargs="+", default=["configs/demo.yaml", "configs/nanogpt_cpu.yaml"]
    )
    args = parser.parse_args()
    print(f"devices: {jax.devices()}")
    c4, c32 = compile_seconds(args.configs[0], 4), compile_seconds(args.configs[0], 32)
    print(
        f"compile time, {args.configs[0]}: 4 layers {c4:.2f}s, 32 layers {c32:.2f}s, "
        f"ratio {c32 / c4:.2f}x"
    )
    for path in args.configs:
        ratios, trainer_times, bare_times, waits = [], [], [], []
        for _ in range(args.rounds):  # interleaved: a busy neighbour slows both sides alike
            trainer_s, max_wait, config = trainer_step_seconds(path, args.steps)
            info = load_dataset(config)
            host = lm_batches(config, info, "train")
            batches = [next(host) for _ in range(8)]
            bare_s = bare_step_seconds(config, info.vocab_size, batches, args.steps)
            ratios.append(trainer_s / bare_s)
            trainer_times.append(trainer_s)
            bare_times.append(bare_s)
            waits.append(max_wait)
        trainer_s, bare_s = statistics.median(trainer_times), statistics.median(bare_times)
        tokens = config.data.global_batch_size * config.data.seq_len
        print(
            f"{path}: trainer {trainer_s * 1e3:.1f} ms/step ({tokens / trainer_s:,.0f} tokens/s, "
            f"max data_wait_frac {max(waits):.3f}); bare jit loop {bare_s * 1e3:.1f} ms/step; "
            f"ratio median {statistics.median(ratios):.3f}x over {args.rounds} rounds "
            f"({', '.join(f'{r:.3f}' for r in ratios)})"
        )


if __name__ == "__main__":
    main()
