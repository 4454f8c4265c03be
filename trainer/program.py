"""Everything the loop runs for one (config, mesh): the model skeleton, the state shardings, the
sharded init, and the jitted train/eval steps. Tests build it directly to compare meshes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from trainer import sharding
from trainer.config import Config
from trainer.optimizer import decay_mask, make_optimizer
from trainer.state import (
    ModelSkeleton,
    TrainState,
    abstract_model,
    abstract_state,
    init_state,
    make_init_fn,
    state_shardings,
)
from trainer.step import LossFn, jit_steps, make_eval_step, make_train_step, next_token_loss


@dataclass(frozen=True)
class TrainProgram:
    mesh: Mesh
    skeleton: ModelSkeleton
    schedule: optax.Schedule
    shardings: TrainState
    batch_sharding: NamedSharding
    num_params: int
    init_fn: Callable[[], TrainState]
    train_step: Callable
    eval_step: Callable
    train_step_into: Callable  # (spare, state, batch): the new state lands in the donated spare

    def init(self) -> TrainState:
        """A fresh state, created directly in its sharded layout."""
        with jax.set_mesh(self.mesh):
            return init_state(self.init_fn, self.shardings)

    def abstract_state(self) -> TrainState:
        """Shapes + target shardings: what a checkpoint restore writes into."""
        return abstract_state(self.shardings, self.init_fn)


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
        shardings = state_shardings(skeleton, tx, abstract_params, mesh)
        batch_sharding = sharding.batch_sharding(mesh)
        train_step, eval_step, train_step_into = jit_steps(
            make_train_step(
                skeleton,
                tx,
                schedule,
                loss_fn,
                config.optim.accum_steps,
                skip_nonfinite=config.optim.skip_nonfinite,
            ),
            make_eval_step(skeleton, loss_fn),
            shardings,
            batch_sharding,
        )
    return TrainProgram(
        mesh=mesh,
        skeleton=skeleton,
        schedule=schedule,
        shardings=shardings,
        batch_sharding=batch_sharding,
        num_params=sum(int(x.size) for x in jax.tree.leaves(abstract_params)),
        init_fn=make_init_fn(build, tx, config.run.seed),
        train_step=train_step,
        eval_step=eval_step,
        train_step_into=train_step_into,
    )
