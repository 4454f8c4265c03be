"""What `trainer.plan` prints, and the sizes it reads: pure functions of measured numbers, so
they are tested without compiling anything."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from trainer.config import Config
from trainer.errors import ConfigError
from trainer.parallel.pipeline import bubble_fraction

# Decimal units as GPU datasheets write them (an "80GB" H100), binary ones as `nvidia-smi` shows.
_UNITS = {
    **{"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12},
    **{"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40},
}


def parse_size(text: str) -> int:
    """`80GB`, `11GiB`, `512MB`, `1.5TB` or a plain byte count, as bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    size = 0
    if match and match.group(2).lower() in _UNITS:
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
        size = int(value) if math.isfinite(value) else 0  # 400 digits read as infinity
    if size < 1:  # zero would divide the fit line by zero
        raise ConfigError(
            f"--device-memory {text!r} is not a size; use e.g. 80GB, 11GiB, 512MB or a byte count"
        )
    return size


def format_bytes(n: float) -> str:
    """Decimal units, as GPU datasheets count (80 GB), to 3 significant digits."""
    return _si(n, "B")


def _si(n: float, unit: str) -> str:
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}"


CPU = "XLA:CPU"
# The XLA:CPU estimate against one H200 (issue 28: configs/1b.yaml, 64 x 2048 in 8 microbatches,
# rows of one document, cuDNN attention; allocator peak vs `trainer.plan` total, same overrides).
CPU_ERROR = (
    "XLA:CPU estimate, not the GPU's buffers: on one H200 it said 68.9 GB for a measured 42.3 GB "
    "peak (1.6x), 229 GB for 76.1 GB with model.remat=none (3.0x), 58.8 GB for 42.3 GB with "
    "optim.offload=true (1.4x; issue 28); --gpu NAME compiles for the GPU instead"
)


@dataclass(frozen=True)
class Footprint:
    """One device's share of a compiled train step, in bytes; `host_*` rest in host memory."""

    params: int
    opt_state: int
    temporaries: int
    total: int  # device memory the step needs (trainer.parallel.offload.device_bytes)
    host_params: int
    host_opt_state: int
    xla_flops: float | None  # compiled step's cost analysis, per device, loop bodies once
    model_flops: float  # the model spec's FLOPs per token (trainer/models/), per device
    mesh: dict[str, int]
    num_params: int
    compiled_for: str = CPU  # XLA:CPU, or the GPU whose compiler laid the step out

    @property
    def other(self) -> int:
        """Step counter, loss scale, batch and the outputs that are not donated in place."""
        return self.total - self.params - self.opt_state - self.temporaries

    @property
    def host(self) -> int:
        return self.host_params + self.host_opt_state


def _xla_flops(flops: float | None) -> str:
    if flops is None:
        return "none (a compile-only GPU executable has no cost analysis)"
    return f"{_si(flops, 'FLOP')} (counts each loop body once: layer scan, microbatches)"


def verdict(total: int, budget: int) -> str:
    """The fit line: it flips from yes to no where the budget drops below the total."""
    answer = "yes" if total <= budget else "no"
    line = f"fits in {format_bytes(budget)} per device: {answer} ({total / budget:.1%} of it)"
    return line + preallocation_note(total, budget)


def preallocation_note(total: int, budget: int) -> str:
    """What a total that fits needs beyond it when it is over the 75% of a GPU that JAX
    preallocates and allocates from ("" otherwise): the run would run out of memory without it."""
    if 0.75 < total / budget <= 1:
        return "; over the 75% JAX takes by default: raise XLA_PYTHON_CLIENT_MEM_FRACTION"
    return ""


def suggestion(change: list[str], total: int, budget: int) -> str:
    """The plan's last line: the change found, its total, and whether it fits `budget`."""
    described = f"{' '.join(change) or 'none'} (total {format_bytes(total)} per device)"
    if total <= budget:
        return f"suggested: {described}{preallocation_note(total, budget)}"
    return f"no change tried fits; the smallest: {described}"


def report(name: str, fp: Footprint, config: Config) -> list[str]:
    """The lines `python -m trainer.plan` prints for one compiled config."""
    mesh = " ".join(f"{axis}={size}" for axis, size in fp.mesh.items())
    stages, microbatches = config.mesh.stage, config.pipeline_microbatches
    rows = {
        "parameters": fp.params,
        "optimizer state": fp.opt_state,
        "activations, temporaries": fp.temporaries,
        "step, batch, metrics": fp.other,
        "total": fp.total,
        "host-resident (pinned_host)": fp.host,
    }
    staged = f" (mesh.stage={stages}, {microbatches} microbatches)" if stages > 1 else ""
    if fp.compiled_for == CPU:
        source = "XLA:CPU buffer assignment of the compiled step; an estimate of a GPU's"
    else:
        source = f"the step compiled for {fp.compiled_for} by XLA's GPU compiler, no GPU used"
    return [
        f"{name} on {math.prod(fp.mesh.values())} devices, mesh {mesh}: "
        f"{fp.num_params / 1e6:.1f}M parameters",
        f"per device ({source}):",
        *(f"  {label:<28}{format_bytes(n):>10}" for label, n in rows.items()),
        f"FLOPs per step per device: {_si(fp.model_flops, 'FLOP')} (the model spec's: 6 x "
        "parameters + attention, no remat recompute)",
        f"  XLA cost_analysis: {_xla_flops(fp.xla_flops)}",
        f"pipeline bubble: {bubble_fraction(stages, microbatches):.1%}{staged}",
        *([CPU_ERROR] if fp.compiled_for == CPU else []),
    ]
