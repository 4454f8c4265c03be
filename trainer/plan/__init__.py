"""`python -m trainer.plan`: a config's per-device memory, FLOPs and pipeline bubble before you rent
the GPUs, from its real train step compiled ahead of time (no array is allocated); when it does
not fit, the change with the least modelled step-time cost that does, itself compiled to check.

    python -m trainer.plan --config configs/1b.yaml --gpu h100 --devices 8 [key=value ...]

With `--gpu NAME` (h200, h100, a100, l4, rtx2080ti, ...: `trainer.plan.gpu.GPUS`; any other name
is bad input) XLA's GPU compiler compiles the step for that GPU, here, without one (jax's CUDA
plugin, the `gpu-plan` extra): its buffer assignment. Without `--gpu`, or where that compile is
impossible (one line says why), XLA:CPU compiles it for N fake CPU devices: an estimate that reads
high (printed beside it), against the GPU's memory. Both against an H200's measured peaks:
BENCHMARKS.md, "Planning for a GPU without one".

Exit 0: fits; 1: does not fit (a suggested change, if one was found, is printed); 2: bad input.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import jax

from input_pipeline.packing import FIELDS
from trainer.config import Config, load_config
from trainer.data import check_batch_layout
from trainer.errors import ConfigError
from trainer.models import builder_for_vocab, model_spec
from trainer.models.attention import precision_warning
from trainer.parallel import sharding
from trainer.parallel.offload import device_bytes
from trainer.plan import cost
from trainer.plan.changes import Step, changes, knob_steps, overrides_of
from trainer.plan.gpu import (
    GPUS,
    Gpu,
    GpuPlanError,
    compile_for_gpu,
    cost_analysis_flops,
    gpu_devices,
    traced_for,
)
from trainer.plan.report import (
    CPU,
    Footprint,
    format_bytes,
    parse_size,
    report,
    suggestion,
    verdict,
)
from trainer.plan.vocab import missing_dataset_note, planned_vocab
from trainer.program import build_program

USAGE_EXIT = 2
COST_MODEL_GPU = "h100"  # whose rates price the suggestions when no --gpu is given


@dataclass(frozen=True)
class Target:
    """What the step is compiled for: XLA:CPU (`gpu` None), or `gpu` through `devices`, that
    many compile-only devices of it."""

    gpu: Gpu | None = None
    devices: tuple[Any, ...] = ()


# ----------------------------------------------------------------------------- compiling


def cpu_devices(count: int) -> list[jax.Device]:
    """`count` fake CPU devices, set up before the JAX backend starts; once it has started (inside
    tests: 8), its first `count`. Either way nothing runs on them: they only shape the compile."""
    try:
        jax.config.update("jax_num_cpu_devices", count)
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # the backend already started with another count
        pass
    devices = jax.devices("cpu")
    if count > len(devices):
        raise ConfigError(
            f"--devices {count} is more than the {len(devices)} CPU devices this process has; "
            f"pass --devices {len(devices)} or fewer, or run python -m trainer.plan on its own"
        )
    return devices[:count]


def measure(
    config: Config,
    devices: list[jax.Device],
    target: Target = Target(),  # noqa: B008  (frozen, compared by value)
    one_document_per_row: bool = False,
) -> Footprint:
    """Compile `config`'s train step for `devices` (for `target.gpu`: traced on them, compiled
    for the GPU) from abstract state and batch; read what one device holds. A config the trainer
    would reject raises the trainer's ConfigError; a GPU compile that fails, GpuPlanError."""
    mesh = sharding.make_mesh(config.mesh, devices)
    rows, seq_len = config.data.global_batch_size, config.data.seq_len
    microbatches = config.pipeline_microbatches if config.mesh.stage > 1 else 1
    check_batch_layout(
        rows, config.optim.accum_steps, mesh.shape["data"] * mesh.shape["fsdp"], 1, microbatches
    )
    vocab = planned_vocab(config)  # the trainer's: model.vocab_size, else the dataset's
    with nullcontext() if target.gpu is None else traced_for(target.gpu):
        program = build_program(config, mesh, builder_for_vocab(config, vocab))
        state = program.abstract_state()
        fields = {k: v for k, v in FIELDS.items() if k != "segment_ids" or not one_document_per_row}
        batch = program.abstract_batch(rows, seq_len, fields)
        with jax.set_mesh(mesh):
            traced = program.train_step.trace(state, batch)
            if target.gpu is None:
                compiled = traced.lower().compile()
            else:
                lowered = traced.lower(lowering_platforms=("cuda",))
    if target.gpu is None:
        total = device_bytes(compiled)
        temporaries = compiled.memory_analysis().temp_size_in_bytes
        xla_flops = cost_analysis_flops(compiled)
    else:
        gpu = compile_for_gpu(lowered, list(mesh.devices.flat), devices, list(target.devices))
        total, temporaries, xla_flops = gpu.device_total, gpu.temporaries, gpu.xla_flops
    params, host_params = resident_bytes(state.params, program.shardings.params)
    opt_state, host_opt = resident_bytes(state.opt_state, program.shardings.opt_state)
    per_token = model_spec(config.model.kind).flops_per_token(config, program.num_params, vocab)
    return Footprint(
        params=params,
        opt_state=opt_state,
        temporaries=temporaries,
        total=total,
        host_params=host_params,
        host_opt_state=host_opt,
        xla_flops=xla_flops,
        model_flops=per_token * rows * seq_len / len(devices),
        mesh=dict(mesh.shape),
        num_params=program.num_params,
        compiled_for=CPU if target.gpu is None else target.gpu.description,
    )


def gpu_target(name: str, count: int) -> Target:
    """`count` compile-only devices of the GPU called `name` (one of `GPUS`: `known_gpu`);
    GpuPlanError says why not."""
    return Target(GPUS[name], tuple(gpu_devices(GPUS[name], count)))


def resident_bytes(tree, shardings) -> tuple[int, int]:
    """(device, host) bytes of one device's shards of `tree`'s leaves under `shardings`."""
    on = {"device": 0, "host": 0}
    for leaf, where in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        nbytes = math.prod(where.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        on["host" if where.memory_kind in ("pinned_host", "unpinned_host") else "device"] += nbytes
    return on["device"], on["host"]


@dataclass(frozen=True)
class Search:
    """How `suggest` compiles and prices the changes it tries."""

    target: Target
    rates: cost.Rates  # the GPU whose rates price each change's step time
    one_document_per_row: bool
    max_tries: int


def suggest(
    path: str,
    overrides: list[str],
    devices: list[jax.Device],
    budget: int,
    base: Footprint,
    search: Search,
) -> tuple[list[str], Footprint]:
    """The first change, least modelled step time first (singles, then pairs), whose compiled
    step fits `budget`, else the smallest one tried. Skipped uncompiled: a change with a step that
    failed to build or saved under 1% alone, and a pair whose steps' measured savings multiplied
    miss by over 25%."""
    config = load_config(path, overrides)
    steps = knob_steps(config, len(devices))
    shape = step_shape(config, base)
    seconds = {s: cost.added_seconds(s.knob, s.settings(), shape, search.rates) for s in steps}
    step_time = cost.step_seconds(shape, search.rates)
    # each step's measured total / base total alone; offloads that cannot save 1% count as 1
    ratio = {s: 1.0 for s in steps if _offloads(s, base) < 0.01 * base.total}
    tries, smallest = 0, ([], base)
    for change in changes(steps, seconds.__getitem__):
        estimate = base.total * math.prod(ratio.get(s, 1.0) for s in change)
        pair_misses = len(change) > 1 and estimate > 1.25 * budget
        if pair_misses or any(ratio.get(s, 0.0) >= 0.99 for s in change):
            continue
        if tries == search.max_tries:
            break
        extra = overrides_of(change)
        try:
            fp = measure(
                load_config(path, [*overrides, *extra]),
                devices,
                search.target,
                search.one_document_per_row,
            )
        except ConfigError as err:
            print(f"  {' '.join(extra)}: skipped, {err}", flush=True)
            ratio.update({change[0]: math.inf} if len(change) == 1 else {})
            continue
        tries += 1
        fits = fp.total <= budget
        added = sum(seconds[s] for s in change)
        priced = f"+{added:.3g} s/step, {added / step_time:+.0%} modelled"
        print(f"  {' '.join(extra)} ({priced}): {format_bytes(fp.total)}{', fits' * fits}")
        if fits:
            return extra, fp
        ratio.update({change[0]: fp.total / base.total} if len(change) == 1 else {})
        smallest = min(smallest, (extra, fp), key=lambda pair: pair[1].total)
    return smallest


def step_shape(config: Config, fp: Footprint) -> cost.Shape:
    """What `trainer.plan.cost` prices a change from: `config`'s step as `fp` measured it."""
    return cost.Shape(
        model_flops=fp.model_flops,
        params=fp.params + fp.host_params,
        opt_state=fp.opt_state + fp.host_opt_state,
        compute_itemsize=jax.numpy.dtype(config.precision.compute).itemsize,
        param_itemsize=jax.numpy.dtype(config.precision.params).itemsize,
        remat=config.model.remat,
        fsdp=fp.mesh["fsdp"],
        accum=config.optim.accum_steps,
        stages=fp.mesh["stage"],
        pipeline_microbatches=config.pipeline_microbatches,
    )


def _offloads(step: Step, base: Footprint) -> float:
    """Bytes an offload step can move off the device at most; infinite for other knobs."""
    return {"offload": base.opt_state, "offload_params": base.params}.get(step.knob, math.inf)


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.plan",
        description="Per-device memory and FLOPs of a config's compiled train step, and the "
        "change with the least modelled step-time cost that makes it fit.",
    )
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--devices", type=int, default=8, help="devices in the mesh (default 8)")
    parser.add_argument(
        "--gpu",
        help=f"compile for this GPU, without one ({', '.join(GPUS)}); default: XLA:CPU estimate",
    )
    parser.add_argument(
        "--device-memory",
        help="memory per device: 80GB, 11GiB, 512MB, bytes (default: the --gpu's, else 80GB)",
    )
    parser.add_argument(
        "--one-document-per-row",
        action="store_true",
        help="batches without segment ids (rows of one document each: cuDNN attention on GPUs "
        "that have it); default: packed rows, as the trainer's data gives",
    )
    parser.add_argument(
        "--max-tries", type=int, default=12, help="changes compiled at most (default 12)"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        known = known_gpu(args.gpu)
        budget = parse_size(args.device_memory or (str(known.memory) if known else "80GB"))
        if args.devices < 1:
            raise ConfigError(f"--devices {args.devices} is not a device count; pass 1 or more")
        if args.max_tries < 0:  # negative would never stop the search
            raise ConfigError(f"--max-tries {args.max_tries} is negative; pass 0 or more")
        config = load_config(args.config, args.overrides)
        note = missing_dataset_note(config)
        devices = cpu_devices(args.devices)
        base, target = _measure_base(config, devices, args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT
    if note:
        print(note)
    print("\n".join(report(args.config, base, config)))
    print(verdict(base.total, budget), flush=True)
    if known and (line := precision_warning(config.precision.compute, known)):
        print(line)
    if base.total <= budget:
        return 0
    rates = (known or GPUS[COST_MODEL_GPU]).rates()
    print(
        f"trying changes, least modelled step time first (an {rates.name}'s rates: "
        f"trainer/plan/cost.py), each compiled (at most {args.max_tries}):"
    )
    search = Search(target, rates, args.one_document_per_row, args.max_tries)
    extra, best = suggest(args.config, args.overrides, devices, budget, base, search)
    print(suggestion(extra, best.total, budget))
    return 1


def known_gpu(name: str | None) -> Gpu | None:
    """The GPU `--gpu` names (any case), None without `--gpu`; a name the plan does not know is
    bad input, since planning on with 80GB would answer for the wrong card."""
    if name is None:
        return None
    if name.lower() in GPUS:
        return GPUS[name.lower()]
    close = difflib.get_close_matches(name.lower(), GPUS, n=1, cutoff=0.6)
    hint = f"did you mean --gpu {close[0]}? " if close else ""
    raise ConfigError(
        f"--gpu {name!r} is not a GPU the plan knows; {hint}pass one of {', '.join(GPUS)}, or "
        "leave --gpu out (XLA:CPU estimate, with --device-memory as the budget)"
    )


def _measure_base(
    config: Config, devices: list[jax.Device], args: argparse.Namespace
) -> tuple[Footprint, Target]:
    """The footprint on `--gpu`'s target, or on XLA:CPU after one line saying why it cannot be."""
    try:
        target = Target() if args.gpu is None else gpu_target(args.gpu.lower(), len(devices))
        return measure(config, devices, target, args.one_document_per_row), target
    except GpuPlanError as err:
        fallback = "planning with XLA:CPU instead"
        print(f"--gpu {args.gpu}: cannot compile for it here: {err}; {fallback}", flush=True)
        return measure(config, devices, Target(), args.one_document_per_row), Target()
