"""Pure train and eval steps, jitted once with explicit shardings and a donated state.

A loss function has the signature `(model, batch) -> (loss, aux)` where `loss` is a mean over
the batch's tokens/examples and `aux` is a dict of scalars. `aux["weight"]` is what the mean is
over (tokens without padding; by default the batch's rows): microbatch accumulation and eval
averaging weigh by it, so `optim.accum_steps=k` gives the same update as one full batch, and the
token rate counts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from trainer.sharding import BATCH_AXES
from trainer.state import ModelSkeleton, TrainState

Batch = dict[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, dict[str, jax.Array]]]


def next_token_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-weighted cross-entropy in float32; padding (weight 0) does not count."""
    logits_BxLxV = model(batch).astype(jnp.float32)
    logprobs_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
    nll_BxL = -jnp.take_along_axis(logprobs_BxLxV, batch["targets"][..., None], axis=-1)[..., 0]
    weights_BxL = batch["weights"].astype(jnp.float32)
    weight = jnp.sum(weights_BxL)
    loss = jnp.sum(nll_BxL * weights_BxL) / jnp.maximum(weight, 1.0)
    return loss, {"weight": weight}


def _weight(aux: dict[str, jax.Array], batch: Batch) -> jax.Array:
    """What the loss is a mean over: `aux["weight"]`, else the batch's rows (examples)."""
    if "weight" in aux:
        return jnp.asarray(aux["weight"], jnp.float32)
    return jnp.float32(jax.tree.leaves(batch)[0].shape[0])


def _split_microbatches(batch: Batch, accum_steps: int) -> Batch:
    """[B, ...] -> [A, B/A, ...] taking every A-th row, so each microbatch stays spread over all
    data-parallel devices instead of living on 1/A of them."""

    def split(x):
        rows = x.shape[0] // accum_steps
        x = x.reshape(rows, accum_steps, *x.shape[1:]).swapaxes(0, 1)
        spec = PartitionSpec(None, BATCH_AXES, *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, spec)

    return jax.tree.map(split, batch)


def make_train_step(
    skeleton: ModelSkeleton,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    loss_fn: LossFn = next_token_loss,
    accum_steps: int = 1,
    skip_nonfinite: bool = False,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The pure step: forward/backward (accumulated over microbatches), clip, AdamW update.

    With `skip_nonfinite`, a step whose loss or gradients are NaN/Inf leaves parameters and
    optimizer state untouched (reported as `skipped=1`) instead of poisoning them."""

    def loss_and_state(params, model_state, batch):
        model = skeleton.merge(params, model_state)
        loss, aux = loss_fn(model, batch)
        new_model_state = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
        weight = _weight(aux, batch)
        return loss * weight, (loss, weight, new_model_state)

    grad_fn = jax.grad(loss_and_state, has_aux=True)

    def accumulate(params, model_state, batch):
        if accum_steps == 1:
            grads, (loss, weight, model_state) = grad_fn(params, model_state, batch)
            return grads, loss * weight, weight, model_state

        def micro(carry, microbatch):
            grad_sum, loss_sum, weight_sum, state = carry
            grads, (loss, weight, state) = grad_fn(params, state, microbatch)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (grad_sum, loss_sum + loss * weight, weight_sum + weight, state), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), model_state)
        (grads, loss_sum, weight_sum, model_state), _ = jax.lax.scan(
            micro, init, _split_microbatches(batch, accum_steps)
        )
        return grads, loss_sum, weight_sum, model_state

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        grads, loss_sum, weight_sum, model_state = accumulate(
            state.params, state.model_state, batch
        )
        scale = 1.0 / jnp.maximum(weight_sum, 1e-9)
        grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss, grad_norm = loss_sum * scale, optax.tree.norm(grads)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(schedule(state.step), jnp.float32),
            "tokens": weight_sum,  # what the loss averaged over (no padding): the token rate
        }
        # One pass over the new parameters: a finite loss can still come with an update that
        # overflows them, and such a state must never reach a checkpoint.
        params_finite = jnp.all(jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(params)]))
        metrics["params_finite"] = params_finite.astype(jnp.float32)
        if skip_nonfinite:
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & params_finite
            keep_old = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            params = jax.tree.map(keep_old, params, state.params)
            opt_state = jax.tree.map(keep_old, opt_state, state.opt_state)
            metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
            metrics["params_finite"] = jnp.ones((), jnp.float32)  # the old ones were kept
        new_state = TrainState(
            step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state
        )
        return new_state, metrics

    return train_step


def make_eval_step(
    skeleton: ModelSkeleton, loss_fn: LossFn = next_token_loss
) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
    """Weighted loss sums, so an eval over several batches averages every token once."""

    def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
        model = skeleton.merge(state.params, state.model_state)
        loss, aux = loss_fn(model, batch)
        weight = _weight(aux, batch)
        return {"loss_sum": loss * weight, "weight": weight}

    return eval_step


def jit_steps(
    train_step, eval_step, state_shardings: TrainState, batch_sharding: NamedSharding
) -> tuple[Any, Any]:
    """Compile-once wrappers with every sharding declared: the state's, the batch's (a prefix:
    every field splits its rows over the batch axes), and a donated train state."""
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    train = jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,),
    )
    evaluate = jax.jit(
        eval_step, in_shardings=(state_shardings, batch_sharding), out_shardings=replicated
    )
    return train, evaluate
