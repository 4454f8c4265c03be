"""What each change `trainer.plan` may suggest costs in step time, modelled: the seconds it adds
to a step from the step's FLOPs and bytes and a GPU's datasheet rates. Suggestions are tried
cheapest first by this figure, and print it. A model, not a measurement; its terms:

- remat: the forward FLOPs it recomputes (save_dots recomputes elementwise work only, counted as
  5% of the forward pass; full recomputes the whole forward pass, a third of 6 x params).
- fsdp: parameters all-gathered for each microbatch's forward and backward passes and the
  gradients reduce-scattered, over the devices' interconnect, not overlapped with compute.
- more microbatches: each re-reads the compute-dtype weights three times (forward, backward,
  remat) from device memory and, under fsdp, gathers them again.
- offload: the optimizer state in and out over the host link, after the backward pass
  (`trainer/parallel/offload.py`: nothing overlaps it); offload_params adds the compute-dtype
  copy in, and the fp32 parameters in and out.
- pipeline stages: the bubble's growth, (S-1)/(M+S-1) of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.parallel.pipeline import bubble_fraction

MFU = 0.5  # achieved/peak FLOP/s: 50.5% measured for configs/1b.yaml on one H200 (gpu/README)
REMAT_RECOMPUTE = {"none": 0.0, "save_dots": 0.05, "offload_dots": 0.05, "full": 1.0}


@dataclass(frozen=True)
class Rates:
    """One device's rates, per second: datasheet peaks, each way where a link is duplex."""

    name: str
    flops: float  # dense bf16/fp16 tensor FLOP/s
    memory_bandwidth: float  # device memory, bytes/s
    host_link: float  # host <-> device (PCIe), bytes/s each way, as achieved by pinned copies
    interconnect: float  # device <-> device (NVLink, else PCIe), bytes/s each way


@dataclass(frozen=True)
class Shape:
    """What the cost terms read of a config's step on one device (bytes are that device's)."""

    model_flops: float  # per step
    params: int  # at-rest parameter bytes
    opt_state: int  # at-rest optimizer state bytes
    compute_itemsize: int  # bytes per parameter of the compute-dtype copy
    param_itemsize: int
    remat: str
    fsdp: int
    accum: int  # microbatches per step
    stages: int
    pipeline_microbatches: int


def step_seconds(shape: Shape, rates: Rates) -> float:
    """The step's compute time at `MFU`, its remat's recompute included."""
    recompute = REMAT_RECOMPUTE[shape.remat] * shape.model_flops / 3
    return (shape.model_flops + recompute) / (rates.flops * MFU)


def added_seconds(knob: str, overrides: dict[str, str], shape: Shape, rates: Rates) -> float:
    """Seconds per step one step of `knob` (its `overrides` applied to `shape`'s config) adds."""
    if knob == "remat":
        more = REMAT_RECOMPUTE[overrides["model.remat"]] - REMAT_RECOMPUTE[shape.remat]
        return more * shape.model_flops / 3 / (rates.flops * MFU)
    if knob == "mesh":
        fsdp = int(overrides["mesh.fsdp"])
        return _gathers(fsdp, shape.accum, shape, rates) - _gathers(
            shape.fsdp, shape.accum, shape, rates
        )
    if knob == "accum":
        accum = int(overrides["optim.accum_steps"])
        reread = 3 * _compute_bytes(shape) / rates.memory_bandwidth
        extra = _gathers(shape.fsdp, accum, shape, rates) - _gathers(
            shape.fsdp, shape.accum, shape, rates
        )
        return (accum - shape.accum) * reread + extra
    if knob == "offload":
        return 2 * shape.opt_state / rates.host_link
    if knob == "offload_params":
        return (_compute_bytes(shape) + 2 * shape.params) / rates.host_link
    if knob == "stage":
        return _bubble_seconds(int(overrides["mesh.stage"]), shape, rates)
    raise ValueError(f"no cost model for knob {knob!r}")


def _compute_bytes(shape: Shape) -> float:
    return shape.params * shape.compute_itemsize / shape.param_itemsize


def _gathers(fsdp: int, accum: int, shape: Shape, rates: Rates) -> float:
    """Seconds of fsdp collectives per step: per microbatch, the compute-dtype parameters
    gathered twice and the gradients reduce-scattered, each moving (1 - 1/fsdp) of the whole."""
    if fsdp == 1:
        return 0.0
    whole = shape.params * shape.fsdp  # all of them: this device holds 1/shape.fsdp
    moved = accum * (2 * whole * shape.compute_itemsize / shape.param_itemsize + whole)
    return moved * (1 - 1 / fsdp) / rates.interconnect


def _bubble_seconds(stages: int, shape: Shape, rates: Rates) -> float:
    """The growth of the pipeline bubble going from `shape.stages` stages to `stages`, the
    microbatch count kept (at least the stage count)."""
    microbatches = max(shape.pipeline_microbatches, stages)
    work = step_seconds(shape, rates)
    before = bubble_fraction(shape.stages, max(shape.pipeline_microbatches, shape.stages))
    after = bubble_fraction(stages, microbatches)
    return work * (after / (1 - after) - before / (1 - before))
