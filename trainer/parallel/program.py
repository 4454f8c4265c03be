"""Everything the loop runs for one (config, mesh): the state and batch shardings, the sharded
init, and the jitted train/eval steps. Tests build it directly to compare meshes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from trainer.config import Config
from trainer.loss_scale import LossScaling
from trainer.optimizer import decay_mask, make_optimizer
from trainer.parallel import sharding
from trainer.parallel.offload import Offload, at_rest
from trainer.parallel.state import (
    TrainState,
    abstract_model,
    abstract_state,
    init_state,
    make_init_fn,
    state_shardings,
)
from trainer.step import Batch, LossFn, jit_steps, make_eval_step, make_train_step, next_token_loss


@dataclass(frozen=True)
class TrainProgram:
    mesh: Mesh
    shardings: TrainState
    batch_sharding: NamedSharding
    num_params: int
    init_fn: Callable[[], TrainState]
    train_step: Callable
    eval_step: Callable

    def init(self) -> TrainState:
        """A fresh state, created directly in its sharded layout."""
        with jax.set_mesh(self.mesh):
            return init_state(self.init_fn, self.shardings)

    def abstract_state(self) -> TrainState:
        """Shapes + target shardings: what a checkpoint restore writes into."""
        return abstract_state(self.shardings, self.init_fn)

    def stepper(self) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
        """The loop's step. Either way a state passed in is consumed, as by donation."""
        if all(device.platform == "cpu" for device in self.mesh.devices.flat):
            return IntoSpareState(self.train_step, self.shardings, self.batch_sharding)
        return self.train_step


class IntoSpareState:
    """XLA:CPU runs the step faster writing into a second, donated state than updating its input
    in place (BENCHMARKS.md, "Double buffering"): each step's input becomes the next one's spare."""

    def __init__(self, train_step: Callable, shardings: TrainState, batch_sharding: NamedSharding):
        def train_step_into(spare: TrainState, state: TrainState, batch: Batch):
            return train_step(state, batch)  # named: profiles show it, not `<lambda>`

        self._step_into = jax.jit(
            train_step_into,
            in_shardings=(shardings, shardings, batch_sharding),
            out_shardings=(shardings, sharding.replicated(batch_sharding.mesh)),
            donate_argnums=(0,),
            keep_unused=True,  # an unused argument is pruned otherwise, and its donation with it
        )
        self._blank = jax.jit(partial(jax.tree.map, jnp.zeros_like), out_shardings=shardings)
        self._last: tuple[TrainState, TrainState] | None = None  # (input, output) of the last step

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        last_input, last_output = self._last or (None, None)
        spare = last_input if state is last_output else self._blank(state)
        new_state, metrics = self._step_into(spare, state, batch)
        self._last = (state, new_state)
        return new_state, metrics


def build_program(
    config: Config,
    mesh: Mesh,
    build: Callable[..., nnx.Module],
    loss_fn: LossFn = next_token_loss,
) -> TrainProgram:
    """Abstract model -> shardings from logical names -> optimizer -> jitted steps."""
    rules = sharding.resolve_rules(config.mesh.rules)
    with jax.set_mesh(mesh):
        skeleton, abstract_params, _ = abstract_model(build, mesh, rules)
        tx, schedule = make_optimizer(
            config.optim, config.run.steps, mask=decay_mask(skeleton.param_specs)
        )
        scaling = LossScaling.from_config(config.precision)
        # the offloaded parts rest in pinned host memory between steps (`offload.py`)
        shardings = at_rest(
            state_shardings(skeleton, tx, abstract_params, mesh, scaling),
            params=config.model.offload_params,
            opt_state=config.optim.offload,
        )
        offload = Offload.of(  # None without offload: no copies compiled in
            shardings, config.precision, decay_mask(skeleton.param_specs)
        )
        batch_sharding = sharding.batch_sharding(mesh)
        train_step, eval_step = jit_steps(
            make_train_step(
                skeleton,
                tx,
                schedule,
                loss_fn,
                config.optim.accum_steps,
                skip_nonfinite=config.optim.skip_nonfinite,
                scaling=scaling,
                offload=offload,
            ),
            make_eval_step(skeleton, loss_fn, offload),
            shardings,
            batch_sharding,
        )
    return TrainProgram(
        mesh=mesh,
        shardings=shardings,
        batch_sharding=batch_sharding,
        num_params=sum(int(x.size) for x in jax.tree.leaves(abstract_params)),
        init_fn=make_init_fn(build, tx, config.run.seed, scaling),
        train_step=train_step,
        eval_step=eval_step,
    )
