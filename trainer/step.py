"""Pure train and eval steps: plain functions of (settings, state, batch). The program
(`trainer.program`) compiles them with its shardings and a donated state; tests and users may
call them directly.

A loss function has the signature `(model, batch) -> (loss, aux)` where `loss` is a mean over
the batch's tokens/examples and `aux` is a dict of scalars. `aux["weight"]` is what the mean is
over (tokens without padding; by default the batch's rows): microbatch accumulation and eval
averaging weigh by it, so `optim.accum_steps=k` gives the same update as one full batch, and the
token rate counts it. Every other aux scalar is a metric under its own name, averaged the way the
loss is (weighted by `weight`); eval logs it as `eval_<name>`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from input_pipeline.errors import DataError
from trainer.errors import ConfigError
from trainer.loss_scale import LossScaling
from trainer.parallel.offload import Offload
from trainer.parallel.sharding import microbatches
from trainer.parallel.state import TrainState

PyTree = Any
Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, dict[str, jax.Array]]]

# The names of a metrics row's own entries (`train_step`, `trainer.loop`, `trainer.observe`):
# an aux scalar of the same name would overwrite one of them, or be overwritten.
ROW_METRICS = frozenset(
    {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "params_finite",
        "loss_scale",
        "skipped",
        "skipped_steps",
        "tokens_per_s",
        "step_time_s",
        "data_wait_frac",
        "tflops_per_device",
        "mfu",
        "corrupt_records_skipped",
        "goodput",
        "ckpt_block_s",
    }
)
# ...and their families: `eval_loss[_<source>]`, `tokens_<source>`, `goodput_<bucket>_s`; an aux
# `loss_<x>` would log as `eval_loss_<x>`, a mixture source's eval loss.
ROW_METRIC_PREFIXES = ("eval_", "tokens_", "goodput_", "loss_")


def next_token_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-weighted cross-entropy in float32; padding (weight 0) does not count."""
    _check_lm_batch(batch)
    _check_takes_batch(model)
    logits_BxLxV = model(batch).astype(jnp.float32)
    logprobs_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
    nll_BxL = -jnp.take_along_axis(logprobs_BxLxV, batch["targets"][..., None], axis=-1)[..., 0]
    weights_BxL = batch["weights"].astype(jnp.float32)
    weight = jnp.sum(weights_BxL)
    loss = jnp.sum(nll_BxL * weights_BxL) / jnp.maximum(weight, 1.0)
    return loss, {"weight": weight}


def _check_lm_batch(batch: Batch) -> None:
    """At trace time: the default loss reads LM batches only, and says so for other batches
    (else a KeyError or a JAX indexing error from inside the backward pass)."""
    missing = [key for key in ("targets", "weights") if key not in batch]
    if missing:
        raise DataError(
            f"the default loss (next-token cross-entropy) reads batch keys 'targets' and "
            f"'weights', and this batch has {sorted(batch)}; pass loss_fn= to trainer.run for "
            "other batches"
        )
    if not jnp.issubdtype(batch["targets"].dtype, jnp.integer):
        raise DataError(
            f"batch['targets'] is {batch['targets'].dtype}; token ids must be integers: yield "
            "them as np.int32"
        )


def _check_takes_batch(model: nnx.Module) -> None:
    """At trace time: the default loss calls `model(batch)`; a model whose `__call__` takes
    other arguments would fail with a TypeError from inside the backward pass."""
    try:
        signature = inspect.signature(model.__call__)
    except (TypeError, ValueError):  # Python cannot tell: call it as documented
        return
    try:
        signature.bind({})
    except TypeError:
        raise ConfigError(
            f"{type(model).__name__}.__call__ takes {signature}, but the default loss calls "
            "model(batch) with the batch dict (inputs, segment_ids, positions); take the "
            "batch, or pass loss_fn= to trainer.run"
        ) from None


@dataclass(frozen=True)
class StepSettings:
    """The static half of a step, fixed at compile time: bind it with
    `functools.partial(train_step, settings)` to get a `(state, batch)` function."""

    graphdef: nnx.GraphDef  # the module's structure; the state carries its values
    tx: optax.GradientTransformation
    schedule: optax.Schedule  # the learning rate the metrics report
    loss_fn: LossFn = next_token_loss
    accum_steps: int = 1
    skip_nonfinite: bool = False
    scaling: LossScaling | None = None  # float16 compute only; None compiles no scaling code
    offload: Offload | None = None  # host-resting state leaves; None compiles no copies


def train_step(
    settings: StepSettings, state: TrainState, batch: Batch
) -> tuple[TrainState, Metrics]:
    """Forward/backward (accumulated over microbatches), clip, AdamW update.

    With `skip_nonfinite`, a step whose loss or gradients are NaN/Inf leaves parameters and
    optimizer state untouched (reported as `skipped=1`) instead of poisoning them. With
    `scaling` (float16 compute), the loss is scaled before the backward pass and the gradients
    unscaled after accumulation; a step whose gradients overflowed is skipped the same way and
    the scale adjusted (`trainer.loss_scale`). With `offload`, the forward gets a compute-dtype
    copy of the host-resting parameters, the rest comes in for the update once the gradients
    exist, and the new state goes out last."""
    offload, scaling = settings.offload, settings.scaling
    params = state.params if offload is None else offload.forward_params(state.params)
    loss_scale = None if scaling is None else state.loss_scale.scale
    grads, loss_sum, weight_sum, aux_sums, model_state = _accumulate(
        settings, params, state.model_state, batch, loss_scale
    )
    if offload is not None:  # the rest comes in for the update, once the gradients exist
        state = offload.to_device(state, after=grads)
    per_item = 1.0 / jnp.maximum(weight_sum, 1e-9)
    unscale = per_item if loss_scale is None else per_item / loss_scale
    grads = jax.tree.map(lambda g: (g * unscale).astype(g.dtype), grads)
    updates, opt_state = settings.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    loss, grad_norm = loss_sum * per_item, optax.tree.norm(grads)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": jnp.asarray(settings.schedule(state.step), jnp.float32),
        "tokens": weight_sum,  # what the loss averaged over (no padding): the token rate
    }
    metrics.update({name: aux_sum * per_item for name, aux_sum in aux_sums.items()})
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
    if settings.skip_nonfinite:
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
    return new_state if offload is None else offload.to_host(new_state), metrics


def eval_step(settings: StepSettings, state: TrainState, batch: Batch) -> dict[str, Any]:
    """Weighted loss (and aux) sums, so an eval over several batches averages every token
    once."""
    if settings.offload is not None:
        state = settings.offload.to_device(state)  # parameters; the unused rest is never copied
    model = nnx.merge(settings.graphdef, state.params, state.model_state)
    model.eval()  # evaluation drops nothing (`deterministic` modules, e.g. model.dropout)
    loss, weight, aux = _call_loss(settings.loss_fn, model, batch)
    return {"loss_sum": loss * weight, "weight": weight, "aux_sums": _weighted(aux, weight)}


def _accumulate(settings: StepSettings, params, model_state, batch: Batch, loss_scale):
    """Gradient, loss, weight and weighted aux sums over `accum_steps` microbatches, and the
    model state."""
    if settings.accum_steps == 1:
        grads, (loss, weight, aux, model_state) = _weighted_grads(
            settings, params, model_state, batch, loss_scale
        )
        return grads, loss * weight, weight, _weighted(aux, weight), model_state

    def micro(carry, microbatch):
        grad_sum, loss_sum, weight_sum, state = carry
        grads, (loss, weight, aux, state) = _weighted_grads(
            settings, params, state, microbatch, loss_scale
        )
        grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
        # stacked by the scan, not carried: the aux names are known once the loss is traced
        aux_parts = _weighted(aux, weight)
        return (grad_sum, loss_sum + loss * weight, weight_sum + weight, state), aux_parts

    offload = settings.offload
    zeros = jax.tree.map(jnp.zeros_like, params if offload is None else offload.widen(params))
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), model_state)
    split = jax.tree.map(lambda x: microbatches(x, settings.accum_steps), batch)
    (grads, loss_sum, weight_sum, model_state), aux_parts = jax.lax.scan(micro, init, split)
    aux_sums = {name: jnp.sum(parts) for name, parts in aux_parts.items()}
    return grads, loss_sum, weight_sum, aux_sums, model_state


def _weighted(aux: Metrics, weight: jax.Array) -> Metrics:
    """Each aux scalar times the weight its mean is over: sums that add up across batches."""
    return {name: value * weight for name, value in aux.items()}


def _weighted_grads(settings: StepSettings, params, model_state, batch: Batch, loss_scale):
    """Gradients of `loss * weight` (times the loss scale, when there is one)."""
    params = params if settings.offload is None else settings.offload.widen(params)
    grad_fn = jax.grad(_loss_and_state, has_aux=True)
    grads, (loss, weight, aux, model_state) = grad_fn(
        params, model_state, batch, loss_scale, settings
    )
    if loss_scale is not None:
        grads = jax.tree.map(lambda g: g * weight.astype(g.dtype), grads)
    return grads, (loss, weight, aux, model_state)


def _loss_and_state(params, model_state, batch: Batch, loss_scale, settings: StepSettings):
    """What the backward pass differentiates, and (loss, weight, aux, new model state) beside
    it."""
    model = nnx.merge(settings.graphdef, params, model_state)
    loss, weight, aux = _call_loss(settings.loss_fn, model, batch)
    new_model_state = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
    if loss_scale is None:
        return loss * weight, (loss, weight, aux, new_model_state)
    # The mean loss is scaled, as fp16 practice has it (the sum would overflow sooner);
    # `_weighted_grads` multiplies by the weight after the backward pass, in fp32.
    return loss * loss_scale, (loss, weight, aux, new_model_state)


def _call_loss(
    loss_fn: LossFn, model: nnx.Module, batch: Batch
) -> tuple[jax.Array, jax.Array, Metrics]:
    """`loss_fn`'s mean loss, what it is a mean over (`aux["weight"]`, else the batch's rows:
    examples) and its other aux scalars. Its result is checked at trace time, where a wrong one
    would otherwise end in a JAX error from inside the backward pass, or (an integer loss) in
    zero gradients."""
    try:
        result = loss_fn(model, batch)
    except KeyError as err:
        _check_key_in_batch(err, batch)
        raise
    if not isinstance(result, tuple | list) or len(result) != 2:
        several = isinstance(result, tuple | list)
        got = f"{len(result)} values" if several else f"a single value ({_describe(result)})"
        raise ConfigError(
            f"loss_fn returned {got}; return a pair (mean loss, aux dict), e.g. "
            "(loss, {'weight': number of examples})"
        )
    loss, aux = result
    if not isinstance(aux, Mapping):
        raise ConfigError(
            f"loss_fn's aux (the second value it returns) is {_describe(aux)}; return a dict "
            "of scalars, e.g. {'weight': number of examples}, or {}"
        )
    if jnp.ndim(loss) != 0 or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        raise ConfigError(
            f"loss_fn returned a loss that is {_describe(loss)}; return one float scalar, the "
            "mean over the batch (e.g. nll.mean())"
        )
    metrics = {name: _aux_metric(name, value) for name, value in aux.items() if name != "weight"}
    if "weight" not in aux:
        return loss, jnp.float32(jax.tree.leaves(batch)[0].shape[0]), metrics
    if jnp.ndim(aux["weight"]) != 0:
        raise ConfigError(
            f"loss_fn's aux['weight'] is {_describe(aux['weight'])}; return one scalar, the "
            "number of examples or tokens the loss is a mean over"
        )
    return loss, jnp.asarray(aux["weight"], jnp.float32), metrics


def _check_key_in_batch(err: KeyError, batch: Batch) -> None:
    """A KeyError naming a key the batch lacks: the data's mistake (or the loss's), said in one
    line with the keys it has, not a traceback from inside the backward pass."""
    key = err.args[0] if len(err.args) == 1 else None
    missing = isinstance(key, str) and isinstance(batch, Mapping) and key not in batch
    if missing and _raised_beside(err, batch):
        raise DataError(
            f"loss_fn raised KeyError({key!r}), a key the batch lacks: it has {sorted(batch)}; "
            f"yield batches with {key!r}, or read the key the data has"
        ) from None


def _raised_beside(err: BaseException, batch: Batch) -> bool:
    """Whether the innermost frame of `err` holds the batch: the lookup that failed was most
    likely on it (a KeyError of a model's own dict, deeper down, is not the data's)."""
    trace = err.__traceback__
    if trace is None:
        return False
    while trace.tb_next is not None:
        trace = trace.tb_next
    return any(value is batch for value in trace.tb_frame.f_locals.values())


def _aux_metric(name: Any, value: Any) -> jax.Array:
    """An aux scalar as the float32 metric it is logged as, checked at trace time: one number,
    under a name no metric of the trainer's own has."""
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"loss_fn's aux has the key {name!r}; name each aux scalar with a non-empty string: "
            "it is logged under that name"
        )
    if (taken := _row_metric_named(name)) is not None:
        raise ConfigError(
            f"loss_fn's aux[{name!r}] has a name the trainer's own metrics use ({taken!r}); "
            f"rename it in loss_fn's aux (e.g. 'aux_{name}')"
        )
    if not _is_real_scalar(value):
        raise ConfigError(
            f"loss_fn's aux[{name!r}] is {_describe(value)}; return one real number per aux "
            "name (e.g. x.mean()): each is logged as a metric"
        )
    return jnp.asarray(value, jnp.float32)


def _row_metric_named(name: str) -> str | None:
    """The trainer's own metric (or family, `eval_*`) that `name` is, if any."""
    if name in ROW_METRICS:
        return name
    return next((f"{prefix}*" for prefix in ROW_METRIC_PREFIXES if name.startswith(prefix)), None)


def _is_real_scalar(value: Any) -> bool:
    """One float, integer or bool: a Python number or a shape-() array."""
    if isinstance(value, bool | int | float):
        return True
    if not (hasattr(value, "shape") and hasattr(value, "dtype")) or tuple(value.shape) != ():
        return False
    dtype = value.dtype
    return jnp.issubdtype(dtype, jnp.bool_) or (
        jnp.issubdtype(dtype, jnp.number) and not jnp.issubdtype(dtype, jnp.complexfloating)
    )


def _describe(value: Any) -> str:
    """A value in an error line: its shape and dtype for an array, else its type."""
    if value is None:
        return "None"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{value.dtype} of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _all_finite(tree: PyTree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))
