"""`python -m trainer.plan`: a config's per-device memory, FLOPs and pipeline bubble before you rent
the GPUs, from its real train step compiled ahead of time for N fake CPU devices (no array is
allocated); when it does not fit, the cheapest change that does, itself compiled to check.

    python -m trainer.plan --config configs/1b.yaml --devices 8 --device-memory 80GB [key=value]

Exit 0: fits; 1: does not fit (a suggested change, if one was found, is printed); 2: bad input.
XLA:CPU lays buffers out as XLA:GPU does in kind, not to the byte (fusion and kernels differ), so
the figures estimate a GPU's.
"""

from __future__ import annotations

import argparse
import math
import sys

import jax

from input_pipeline.packing import FIELDS
from trainer.config import Config, load_config
from trainer.data import check_config_batch_layout
from trainer.errors import ConfigError
from trainer.observe.flops import flops_per_token
from trainer.parallel import sharding
from trainer.parallel.offload import device_bytes
from trainer.parallel.program import build_program
from trainer.plan.changes import Step, changes, knob_steps, overrides_of
from trainer.plan.report import Footprint, format_bytes, parse_size, report, verdict
from trainer.train import builder_for_vocab

USAGE_EXIT = 2
DEFAULT_VOCAB = 256  # model.vocab_size unset: the built-in corpora's byte-level vocabulary


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


def measure(config: Config, devices: list[jax.Device]) -> Footprint:
    """Compile `config`'s train step for `devices` from abstract state and batch; read what one
    device holds. A config the trainer would reject raises the trainer's ConfigError."""
    mesh = sharding.make_mesh(config.mesh, devices)
    rows, seq_len = config.data.global_batch_size, config.data.seq_len
    check_config_batch_layout(config, mesh.shape["data"] * mesh.shape["fsdp"])
    vocab = config.model.vocab_size or DEFAULT_VOCAB
    program = build_program(config, mesh, builder_for_vocab(config, vocab))
    state = program.abstract_state()
    batch = {
        name: jax.ShapeDtypeStruct((rows, seq_len), dtype, sharding=program.batch_sharding)
        for name, dtype in FIELDS.items()
    }
    with jax.set_mesh(mesh):
        compiled = program.train_step.lower(state, batch).compile()
    kept = compiled.input_shardings[0][0]  # the state's shardings, memory kinds included
    params, host_params = resident_bytes(state.params, kept.params)
    opt_state, host_opt = resident_bytes(state.opt_state, kept.opt_state)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    builtin = config.model.kind == "transformer"
    per_token = flops_per_token(config, program.num_params, vocab, builtin)
    return Footprint(
        params=params,
        opt_state=opt_state,
        temporaries=compiled.memory_analysis().temp_size_in_bytes,
        total=device_bytes(compiled),
        host=host_params + host_opt,
        xla_flops=float(cost.get("flops", 0.0)),
        model_flops=per_token * rows * seq_len / len(devices),
        mesh=dict(mesh.shape),
        num_params=program.num_params,
    )


def resident_bytes(tree, shardings) -> tuple[int, int]:
    """(device, host) bytes of one device's shards of `tree`'s leaves under `shardings`."""
    on = {"device": 0, "host": 0}
    for leaf, where in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        nbytes = math.prod(where.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        on["host" if where.memory_kind in ("pinned_host", "unpinned_host") else "device"] += nbytes
    return on["device"], on["host"]


def suggest(
    path: str,
    overrides: list[str],
    devices: list[jax.Device],
    budget: int,
    base: Footprint,
    max_tries: int = 12,
) -> tuple[list[str], Footprint]:
    """The first change (cheapest first, then pairs) whose compiled step fits `budget`, else the
    smallest one tried. Skipped uncompiled: a change with a step that failed to build or saved
    under 1% alone, and a pair whose steps' measured savings multiplied miss by over 25%."""
    steps = knob_steps(load_config(path, overrides), len(devices))
    # each step's measured total / base total alone; offloads that cannot save 1% count as 1
    ratio = {s: 1.0 for s in steps if _offloads(s, base) < 0.01 * base.total}
    tries, smallest = 0, ([], base)
    for change in changes(steps):
        estimate = base.total * math.prod(ratio.get(s, 1.0) for s in change)
        pair_misses = len(change) > 1 and estimate > 1.25 * budget
        if pair_misses or any(ratio.get(s, 0.0) >= 0.99 for s in change):
            continue
        if tries == max_tries:
            break
        extra = overrides_of(change)
        try:
            fp = measure(load_config(path, [*overrides, *extra]), devices)
        except ConfigError as err:
            print(f"  {' '.join(extra)}: skipped, {err}", flush=True)
            ratio.update({change[0]: math.inf} if len(change) == 1 else {})
            continue
        tries += 1
        fits = fp.total <= budget
        print(f"  {' '.join(extra)}: {format_bytes(fp.total)}{', fits' * fits}", flush=True)
        if fits:
            return extra, fp
        ratio.update({change[0]: fp.total / base.total} if len(change) == 1 else {})
        smallest = min(smallest, (extra, fp), key=lambda pair: pair[1].total)
    return smallest


def _offloads(step: Step, base: Footprint) -> float:
    """Bytes an offload step can move off the device at most; infinite for other knobs."""
    return {"offload": base.opt_state, "offload_params": base.params}.get(step.knob, math.inf)


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.plan",
        description="Per-device memory and FLOPs of a config's compiled train step, and the "
        "cheapest change that makes it fit.",
    )
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--devices", type=int, default=8, help="devices in the mesh (default 8)")
    parser.add_argument(
        "--device-memory", default="80GB", help="memory per device: 80GB, 11GiB, 512MB, bytes"
    )
    parser.add_argument(
        "--max-tries", type=int, default=12, help="changes compiled at most (default 12)"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        budget = parse_size(args.device_memory)
        if args.devices < 1:
            raise ConfigError(f"--devices {args.devices} is not a device count; pass 1 or more")
        config = load_config(args.config, args.overrides)
        devices = cpu_devices(args.devices)
        base = measure(config, devices)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT
    print("\n".join(report(args.config, base, config)))
    print(verdict(base.total, budget), flush=True)
    if base.total <= budget:
        return 0
    print(f"trying changes, cheapest first, each compiled (at most {args.max_tries}):")
    extra, best = suggest(args.config, args.overrides, devices, budget, base, args.max_tries)
    change = f"{' '.join(extra) or 'none'} (total {format_bytes(best.total)} per device)"
    if best.total <= budget:
        print(f"suggested: {change}")
    else:
        print(f"no change tried fits; the smallest: {change}")
    return 1
