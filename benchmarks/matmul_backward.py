"""Is the explicit-VJP bf16 matmul (`trainer/models/matmul.py`) worth keeping on this backend?

Times the jitted train step (forward, backward, AdamW) of one config, bf16 compute, with every
dense layer's matmul as the explicit VJP vs plain `jax.lax.dot_general` (what autodiff does with
it), in interleaved rounds so a busy neighbour slows both alike; prints the median ratio.

    python benchmarks/matmul_backward.py [--config configs/nanogpt_cpu.yaml] [--rounds 7]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import _repo_root  # noqa: F401  (before any project import: see its docstring)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks._cli import positive_int, repo_file, run_main
from trainer.config import Config, load_config
from trainer.models import build_model
from trainer.models.matmul import mixed_precision_dot_general

VARIANTS = {"explicit_vjp": mixed_precision_dot_general, "plain": jax.lax.dot_general}


def packed_batch(config: Config, vocab_size: int) -> dict[str, jax.Array]:
    """Random tokens in rows of two documents each (the attention mask costs the same)."""
    B, L = config.data.global_batch_size, config.data.seq_len
    tokens = np.random.default_rng(0).integers(0, vocab_size, (B, L + 1)).astype(np.int32)
    split = L // 3
    segment_ids = np.where(np.arange(L) < split, 1, 2).astype(np.int32)
    positions = np.where(np.arange(L) < split, np.arange(L), np.arange(L) - split)
    return {
        "inputs": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "segment_ids": jnp.asarray(np.broadcast_to(segment_ids, (B, L))),
        "positions": jnp.asarray(np.broadcast_to(positions.astype(np.int32), (B, L))),
    }


def make_step(config: Config, vocab_size: int, dot_general):
    """The model with `dot_general` in every dense layer, AdamW, and one jitted train step."""
    model = build_model(
        config.model,
        vocab_size=vocab_size,
        rngs=nnx.Rngs(0),
        compute_dtype="bfloat16",
        param_dtype=config.precision.params,
    )
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear):
            node.dot_general = dot_general
    graphdef, params = nnx.split(model)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(batch)
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)
            return jnp.mean(nll)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, [params, tx.init(params)]


def seconds_per_step(step, state: list, batch: dict, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        state[0], state[1], loss = step(state[0], state[1], batch)
    jax.block_until_ready(loss)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=repo_file("configs/nanogpt_cpu.yaml"))
    parser.add_argument(
        "--steps", type=positive_int, default=50, help="timed steps per variant and round"
    )
    parser.add_argument("--rounds", type=positive_int, default=7)
    args = parser.parse_args()
    config = load_config(args.config, [])
    vocab_size = config.model.vocab_size or 256  # byte-level datasets
    batch = packed_batch(config, vocab_size)
    runs = {name: make_step(config, vocab_size, fn) for name, fn in VARIANTS.items()}
    for step, state in runs.values():
        seconds_per_step(step, state, batch, 3)  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(args.rounds):  # interleaved, alternating which goes first
        order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(seconds_per_step(*runs[name], batch, args.steps))
    ratios = [p / e for p, e in zip(times["plain"], times["explicit_vjp"], strict=True)]
    print(
        f"devices: {jax.devices()}; {args.config}, bf16 compute, {args.steps} steps x {args.rounds}"
    )
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values) * 1e3:.2f} ms/step")
    print(
        f"plain / explicit_vjp step time: median {statistics.median(ratios):.3f}x "
        f"({', '.join(f'{r:.3f}' for r in ratios)})"
    )


if __name__ == "__main__":
    sys.exit(run_main(main))
