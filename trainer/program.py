"""Everything the loop runs for one (config, mesh): the state and batch shardings, the sharded
init, and the pure steps of `trainer.step` compiled with them. Tests build it directly to
compare meshes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from input_pipeline.packing import FIELDS
from trainer.config import Config
from trainer.loss_scale import LossScaling
from trainer.optimizer import decay_mask, make_optimizer
from trainer.parallel import sharding
from trainer.parallel.offload import Offload, at_rest
from trainer.parallel.state import (
    ModelSkeleton,
    TrainState,
    abstract_model,
    make_init_fn,
    state_shardings,
    with_shardings,
)
from trainer.step import Batch, LossFn, StepSettings, eval_step, next_token_loss, train_step


@dataclass(frozen=True)
class TrainProgram:
    """One (config, mesh)'s shardings, sharded init and compiled steps."""

    mesh: Mesh
    skeleton: ModelSkeleton  # the module's graph and its parameters' layout
    shardings: TrainState
    batch_sharding: NamedSharding
    num_params: int
    init_fn: Callable[[], TrainState]
    settings: StepSettings  # what the steps were compiled with: `trainer.step` takes it too
    train_step: Callable  # jitted (state, batch) -> (state, metrics); the state is donated
    eval_step: Callable  # jitted (state, batch) -> weighted loss sums

    def init(self) -> TrainState:
        """A fresh state, created directly in its sharded layout."""
        with jax.set_mesh(self.mesh):
            return jax.jit(self.init_fn, out_shardings=self.shardings)()

    def abstract_state(self) -> TrainState:
        """Shapes + target shardings: what a checkpoint restore writes into."""
        return with_shardings(jax.eval_shape(self.init_fn), self.shardings)

    def abstract_batch(
        self, rows: int, seq_len: int, fields: Mapping[str, type] = FIELDS
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes, dtypes and sharding of a packed batch (`input_pipeline.packing`): what the
        steps are traced with when nothing is read."""
        return {
            name: jax.ShapeDtypeStruct((rows, seq_len), dtype, sharding=self.batch_sharding)
            for name, dtype in fields.items()
        }

    def stepper(
        self, in_place: bool | None = None
    ) -> Callable[[TrainState, Batch], tuple[TrainState, StepMetrics]]:
        """The loop's step: the train step with its metrics packed (`StepMetrics`), in place, or
        into a spare state where `in_place` is None and the mesh is CPUs. Either way a state
        passed in is consumed, as by donation."""

        def train_step_packed(state: TrainState, batch: Batch):  # named: profiles show it
            state, metrics = self.train_step(state, batch)
            return state, StepMetrics.pack(metrics)

        if in_place is None:  # XLA:CPU steps faster into a spare state (`IntoSpareState`)
            in_place = any(device.platform != "cpu" for device in self.mesh.devices.flat)
        if in_place:
            return jit_train_step(train_step_packed, self.shardings, self.batch_sharding)
        return IntoSpareState(train_step_packed, self.shardings, self.batch_sharding)


def jit_train_step(
    step: Callable, shardings: TrainState, batch_sharding: NamedSharding
) -> Callable[[TrainState, Batch], tuple]:
    """`step` compiled with every sharding declared, the batch's as a prefix (every field splits
    its rows over the batch axes), and the state donated."""
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, sharding.replicated(batch_sharding.mesh)),
        donate_argnums=(0,),
    )


@struct.dataclass
class StepMetrics:
    """A step's metrics as one float32 vector on the devices: the loop starts one
    device-to-host copy per step and checks one array for readiness, not one per metric (each
    costs ~30 us of Python on the host, benchmarks/loop_overhead.py)."""

    values: jax.Array
    names: tuple[str, ...] = struct.field(pytree_node=False)

    @classmethod
    def pack(cls, metrics: dict[str, jax.Array]) -> StepMetrics:
        values = jnp.stack([jnp.asarray(value, jnp.float32) for value in metrics.values()])
        return cls(values, tuple(metrics))

    def start_copy(self) -> None:
        """Queue the copy to the host behind the step, so `read` takes no round trip."""
        self.values.copy_to_host_async()

    def is_ready(self) -> bool:
        return self.values.is_ready()

    def read(self) -> dict[str, float]:
        """The values on the host (waits for the step to finish)."""
        return dict(zip(self.names, jax.device_get(self.values).tolist(), strict=True))


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

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, StepMetrics]:
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
    """Abstract model -> shardings from logical names -> optimizer -> compiled steps."""
    rules = sharding.resolve_rules(config.mesh.rules)
    with jax.set_mesh(mesh):
        skeleton, abstract_params, _ = abstract_model(build, mesh, rules)
        sharding.check_rules_used(config.mesh.rules, skeleton.logical_axes)
        matrices = decay_mask(skeleton.param_specs)  # weight-decayed; cast by every forward
        tx, schedule = make_optimizer(config.optim, config.run.steps, mask=matrices)
        scaling = LossScaling.from_config(config.precision)
        # the offloaded parts rest in pinned host memory between steps (`offload.py`)
        shardings = at_rest(
            state_shardings(skeleton, tx, abstract_params, mesh, scaling),
            params=config.model.offload_params,
            opt_state=config.optim.offload,
        )
    settings = StepSettings(
        graphdef=skeleton.graphdef,
        tx=tx,
        schedule=schedule,
        loss_fn=loss_fn,
        accum_steps=config.optim.accum_steps,
        skip_nonfinite=config.optim.skip_nonfinite,
        scaling=scaling,
        offload=Offload.of(shardings, config.precision, matrices),
    )
    batch_sharding = sharding.batch_sharding(mesh)
    return TrainProgram(
        mesh=mesh,
        skeleton=skeleton,
        shardings=shardings,
        batch_sharding=batch_sharding,
        num_params=sum(int(x.size) for x in jax.tree.leaves(abstract_params)),
        init_fn=make_init_fn(build, tx, config.run.seed, scaling),
        settings=settings,
        train_step=jit_train_step(partial(train_step, settings), shardings, batch_sharding),
        eval_step=jax.jit(
            partial(eval_step, settings),
            in_shardings=(shardings, batch_sharding),
            out_shardings=sharding.replicated(mesh),
        ),
    )
