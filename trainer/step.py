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

from trainer.loss_scale import LossScaling
from trainer.parallel.offload import Offload
from trainer.parallel.sharding import BATCH_AXES
from trainer.parallel.state import ModelSkeleton, TrainState

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
    scaling: LossScaling | None = None,
    offload: Offload | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The pure step: forward/backward (accumulated over microbatches), clip, AdamW update.

    With `skip_nonfinite`, a step whose loss or gradients are NaN/Inf leaves parameters and
    optimizer state untouched (reported as `skipped=1`) instead of poisoning them. With
    `scaling` (float16 compute), the loss is scaled before the backward pass and the gradients
    unscaled after accumulation; a step whose gradients overflowed is skipped the same way and
    the scale adjusted (`trainer.loss_scale`). Without it, no scaling code is compiled in. With
    `offload`, the forward gets a compute-dtype copy of the host-resting parameters, the rest
    comes in for the update once the gradients exist, and the new state goes out last."""

    def loss_and_state(params, model_state, batch, loss_scale):
        model = skeleton.merge(params, model_state)
        loss, aux = loss_fn(model, batch)
        new_model_state = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
        weight = _weight(aux, batch)
        if loss_scale is None:
            return loss * weight, (loss, weight, new_model_state)
        # The mean loss is scaled, as fp16 practice has it (the sum would overflow sooner);
        # `weighted_grads` multiplies by the weight after the backward pass, in fp32.
        return loss * loss_scale, (loss, weight, new_model_state)

    grad_fn = jax.grad(loss_and_state, has_aux=True)

    def weighted_grads(params, model_state, batch, loss_scale):
        """Gradients of `loss * weight` (times the loss scale, when there is one)."""
        params = params if offload is None else offload.widen(params)  # offload.py
        grads, (loss, weight, model_state) = grad_fn(params, model_state, batch, loss_scale)
        if loss_scale is not None:
            grads = jax.tree.map(lambda g: g * weight.astype(g.dtype), grads)
        return grads, (loss, weight, model_state)

    def accumulate(params, model_state, batch, loss_scale):
        if accum_steps == 1:
            grads, (loss, weight, model_state) = weighted_grads(
                params, model_state, batch, loss_scale
            )
            return grads, loss * weight, weight, model_state

        def micro(carry, microbatch):
            grad_sum, loss_sum, weight_sum, state = carry
            grads, (loss, weight, state) = weighted_grads(params, state, microbatch, loss_scale)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (grad_sum, loss_sum + loss * weight, weight_sum + weight, state), None

        zeros = jax.tree.map(jnp.zeros_like, params if offload is None else offload.widen(params))
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), model_state)
        (grads, loss_sum, weight_sum, model_state), _ = jax.lax.scan(
            micro, init, _split_microbatches(batch, accum_steps)
        )
        return grads, loss_sum, weight_sum, model_state

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        params = state.params if offload is None else offload.forward_params(state.params)
        loss_scale = None if scaling is None else state.loss_scale.scale
        grads, loss_sum, weight_sum, model_state = accumulate(
            params, state.model_state, batch, loss_scale
        )
        if offload is not None:  # the rest comes in for the update, once the gradients exist
            state = offload.to_device(state, after=grads)
        per_item = 1.0 / jnp.maximum(weight_sum, 1e-9)
        unscale = per_item if loss_scale is None else per_item / loss_scale
        grads = jax.tree.map(lambda g: (g * unscale).astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss, grad_norm = loss_sum * per_item, optax.tree.norm(grads)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(schedule(state.step), jnp.float32),
            "tokens": weight_sum,  # what the loss averaged over (no padding): the token rate
        }
        # One pass over the new parameters: a finite loss can still come with an update that
        # overflows them, and such a state must never reach a checkpoint.
        params_finite = _all_finite(params)
        metrics["params_finite"] = params_finite.astype(jnp.float32)
        keep = None  # whether this step's update is applied, where a step may be skipped
        new_loss_scale = None
        if scaling is not None:
            # An overflow anywhere makes the global norm non-finite: the norm the clip computes
            # anyway is the check, where a reduction per gradient was one more pass over them
            # all (a norm beyond ~1e19, equally untrainable, counts as an overflow too).
            keep = jnp.isfinite(grad_norm)  # global arrays: every device's and host's gradients
            new_loss_scale = scaling.update(state.loss_scale, keep)
            metrics["loss_scale"] = loss_scale  # the scale this step ran with
        if skip_nonfinite:
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & params_finite
            keep = finite if keep is None else keep & finite
        if keep is not None:
            keep_old = lambda new, old: jnp.where(keep, new, old)  # noqa: E731
            params = jax.tree.map(keep_old, params, state.params)
            opt_state = jax.tree.map(keep_old, opt_state, state.opt_state)
            metrics["skipped"] = 1.0 - keep.astype(jnp.float32)
            metrics["params_finite"] = jnp.where(keep, params_finite, True).astype(jnp.float32)
        new_state = TrainState(
            step=state.step + 1,
            params=params,
            model_state=model_state,
            opt_state=opt_state,
            loss_scale=new_loss_scale,
        )
        if offload is not None:
            new_state = offload.to_host(new_state)
        return new_state, metrics

    return train_step


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


def make_eval_step(
    skeleton: ModelSkeleton, loss_fn: LossFn = next_token_loss, offload: Offload | None = None
) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
    """Weighted loss sums, so an eval over several batches averages every token once."""

    def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
        if offload is not None:
            state = offload.to_device(state)  # parameters; the unused rest is never copied
        model = skeleton.merge(state.params, state.model_state)
        model.eval()  # evaluation drops nothing (`deterministic` modules, e.g. model.dropout)
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
