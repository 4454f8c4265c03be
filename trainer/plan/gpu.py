"""Compiling the train step for a GPU that is not here (`python -m trainer.plan --gpu NAME`).

XLA compiles for a described GPU without one: jax's CUDA plugin (the `gpu-plan` extra; no driver
or GPU needed) makes compile-only devices from a `GpuTargetConfigProto`
(`jax.experimental.topologies`). The step is traced on the plan's CPU devices and lowered for
CUDA, because jax 0.10's compile-only GPU devices list no memories and would drop the pinned-host
placement of offloaded state; the plugin then compiles that module for the GPU. Its memory
analysis is the GPU's buffer assignment, host bytes reported apart (against an H200's measured
peaks: BENCHMARKS.md, "Planning for a GPU without one").

Three things reach into jax's private modules, all here, each failing into `GpuPlanError`:
the compile options and the compile-only client's `compile`, and the trace-time checks of jax's
cuDNN attention, which ask the *local* GPU for its compute capability and cuDNN version
(`answering_cudnn_checks`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from trainer.errors import first_line
from trainer.models.attention import parse_capability
from trainer.models.kernels import planned_device
from trainer.observe.flops import peak_tflops_of
from trainer.plan.cost import Rates


class GpuPlanError(Exception):
    """The plan cannot compile for the GPU here; the message is one line saying why."""


@dataclass(frozen=True)
class Gpu:
    """What XLA's GPU compiler reads of a GPU (a subset of `GpuTargetConfigProto`), from the
    vendor's datasheet and, where XLA keeps one, its spec file
    (xla/backends/gpu/target_config/specs/*.txtpb)."""

    description: str
    capability: tuple[int, int]
    cores: int  # streaming multiprocessors
    memory: int  # bytes, the total the CUDA driver reports
    bandwidth: float  # memory bandwidth, bytes/s
    l2_cache: float  # bytes
    clock_ghz: float
    shared_per_core: int  # shared memory per multiprocessor, bytes
    shared_per_block_optin: int
    threads_per_core: int
    fpus_per_core: int
    host_link: float  # PCIe bytes/s each way, as pinned copies achieve
    interconnect: float  # NVLink bytes/s each way; PCIe's where the GPU has none

    platform = "gpu"  # read as a `jax.Device` is, by `attention.precision_warning`

    @property
    def device_kind(self) -> str:
        return self.description

    @property
    def peak_flops(self) -> float:
        """Dense 16-bit tensor FLOP/s (fp32 accumulate), for `cost.Rates`: the peak a run's MFU
        on this GPU divides by."""
        peak = peak_tflops_of(self.description)
        if peak is None:
            raise KeyError(f"{self.description!r} has no peak in trainer.observe.flops.PEAK_TFLOPS")
        return 1e12 * peak

    @property
    def compute_capability(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"

    def rates(self) -> Rates:
        return Rates(self.description, self.peak_flops, self.bandwidth, self.host_link,
                     self.interconnect)  # fmt: skip

    def target_config(self) -> str:
        """The `GpuTargetConfigProto` text the CUDA plugin's topology takes as `target_config`."""
        major, minor = self.capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_per_core}
  threads_per_core_limit: {self.threads_per_core}
  core_count: {self.cores}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth)}
  l2_cache_size: {int(self.l2_cache)}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory}
  shared_memory_per_block_optin: {self.shared_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{self.description}"
"""


GB = 10**9
MiB = 2**20
PCIE3, PCIE4, PCIE5 = 12 * GB, 25 * GB, 53 * GB  # achieved pinned-copy rates, each way
# fmt: off
# Per-multiprocessor figures, shared by every GPU of a compute capability.
_SM90 = {"shared_per_core": 233472, "shared_per_block_optin": 232448,
         "threads_per_core": 2048, "fpus_per_core": 128}
_SM80 = {"shared_per_core": 167936, "shared_per_block_optin": 166912,
         "threads_per_core": 2048, "fpus_per_core": 64}
_SM86_89 = {"shared_per_core": 102400, "shared_per_block_optin": 101376,
            "threads_per_core": 1536, "fpus_per_core": 128}
_SM75 = {"shared_per_core": 65536, "shared_per_block_optin": 65536,
         "threads_per_core": 1024, "fpus_per_core": 64}

GPUS: dict[str, Gpu] = {
    "h200": Gpu(
        "NVIDIA H200 141GB HBM3e", (9, 0), 132, 151397597184, 4.8e12, 50 * MiB, 1.98, **_SM90,
        host_link=PCIE5, interconnect=450 * GB,
    ),
    "h100": Gpu(
        "NVIDIA H100 80GB HBM3", (9, 0), 132, 84942979072, 3.35232e12, 50 * MiB, 1.98, **_SM90,
        host_link=PCIE5, interconnect=450 * GB,
    ),
    "a100": Gpu(
        "NVIDIA A100-SXM4-80GB", (8, 0), 108, 85100068864, 2.03904e12, 40 * MiB, 1.41, **_SM80,
        host_link=PCIE4, interconnect=300 * GB,
    ),
    "a100-40gb": Gpu(
        "NVIDIA A100-SXM4-40GB", (8, 0), 108, 42331013120, 1.5552e12, 40 * MiB, 1.41, **_SM80,
        host_link=PCIE4, interconnect=300 * GB,
    ),
    "l4": Gpu(
        "NVIDIA L4", (8, 9), 58, 23034 * MiB, 300e9, 48 * MiB, 2.04, **_SM86_89,
        host_link=PCIE4, interconnect=PCIE4,
    ),
    "rtx4090": Gpu(
        "NVIDIA GeForce RTX 4090", (8, 9), 128, 24564 * MiB, 1008e9, 72 * MiB, 2.52, **_SM86_89,
        host_link=PCIE4, interconnect=PCIE4,
    ),
    "rtx3090": Gpu(
        "NVIDIA GeForce RTX 3090", (8, 6), 82, 24576 * MiB, 936e9, 6 * MiB, 1.695, **_SM86_89,
        host_link=PCIE4, interconnect=PCIE4,
    ),
    "v100": Gpu(
        "Tesla V100-SXM2-16GB", (7, 0), 80, 16935682048, 898.048e9, 6 * MiB, 1.53,
        shared_per_core=98304, shared_per_block_optin=98304,
        threads_per_core=2048, fpus_per_core=64,
        host_link=PCIE3, interconnect=150 * GB,
    ),
    "t4": Gpu(
        "Tesla T4", (7, 5), 40, 15360 * MiB, 320e9, 4 * MiB, 1.59, **_SM75,
        host_link=PCIE3, interconnect=PCIE3,
    ),
    "rtx2080ti": Gpu(
        "NVIDIA GeForce RTX 2080 Ti", (7, 5), 68, 11264 * MiB, 616e9, 5.5 * MiB, 1.545, **_SM75,
        host_link=PCIE3, interconnect=PCIE3,
    ),
}
# fmt: on


def gpu_devices(gpu: Gpu, count: int) -> list[Any]:
    """`count` compile-only devices of `gpu`, eight to a host where they divide so."""
    hosts = count // 8 if count > 8 and count % 8 == 0 else 1
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(
            platform="cuda",
            target_config=gpu.target_config(),
            topology=f"1x{hosts}x{count // hosts}",
        )
    except NotImplementedError:
        raise GpuPlanError(
            "jax's CUDA plugin is not installed (pip install -e '.[gpu-plan]'; no GPU needed)"
        ) from None
    except Exception as err:  # the plugin rejects the description: say so, never crash
        raise GpuPlanError(f"the CUDA plugin cannot describe it ({first_line(err)})") from None
    return list(topology.devices)


@contextmanager
def traced_for(gpu: Gpu) -> Iterator[None]:
    """Inside: the model picks its kernels for `gpu` (`kernels.planned_device`), and jax's cuDNN
    attention, which asks the local GPU at trace time, gets `gpu`'s answers."""
    with planned_device("gpu", gpu.compute_capability), answering_cudnn_checks(gpu):
        yield


_CUDNN_MODULE = "jax._src.cudnn.fused_attention_stablehlo"
_CUDNN_VERSION = 91000  # 9.10: what jax 0.10-0.12's CUDA 12 plugins ship with


@contextmanager
def answering_cudnn_checks(gpu: Gpu) -> Iterator[None]:
    """jax's cuDNN attention checks, while tracing, the cuDNN library and the local GPU's compute
    capability; here they answer for `gpu` (restored on exit)."""
    try:
        module = importlib.import_module(_CUDNN_MODULE)
    except ImportError as err:
        raise GpuPlanError(f"this jax has no {_CUDNN_MODULE} ({err})") from None
    answers = {
        "check_cudnn_version": lambda: _CUDNN_VERSION,
        "check_compute_capability": lambda c: parse_capability(c) <= gpu.capability,
        "is_cuda_compute_capability_equal": lambda c: parse_capability(c) == gpu.capability,
    }
    missing = [name for name in answers if not hasattr(module, name)]
    if missing:
        raise GpuPlanError(f"this jax's cuDNN attention moved ({_CUDNN_MODULE}.{missing[0]})")
    saved = {name: getattr(module, name) for name in answers}
    try:
        for name, answer in answers.items():
            setattr(module, name, answer)
        yield
    finally:
        for name, original in saved.items():
            setattr(module, name, original)


@dataclass(frozen=True)
class GpuCompiled:
    """What the plan reads of a step compiled for a GPU: one device's bytes and XLA's FLOPs."""

    device_total: int  # arguments + outputs - donated + temporaries, device memory only
    temporaries: int
    xla_flops: float | None  # None: the compile-only executable gives no cost analysis


def compile_for_gpu(
    lowered: jax.stages.Lowered, mesh_devices: list[Any], cpus: list[Any], gpus: list[Any]
) -> GpuCompiled:
    """Compile `lowered` (traced on a mesh of `mesh_devices` taken from `cpus`, lowered for CUDA)
    for `gpus`: the CPU device at each mesh position replaced by the GPU of the same index."""
    try:
        from jax._src import compiler
        from jax._src.lib import xla_client

        order = [gpus[cpus.index(device)] for device in mesh_devices]
        options = compiler.get_compile_options(
            num_replicas=1,
            num_partitions=len(order),
            device_assignment=np.array(order).reshape(1, len(order)),
        )
        options.executable_build_options.use_shardy_partitioner = (
            jax.config.jax_use_shardy_partitioner
        )
        executable = order[0].client.compile(
            lowered.compiler_ir(),
            executable_devices=xla_client.DeviceList(tuple(order)),
            compile_options=options,
        )
        stats = executable.get_compiled_memory_stats()
    except Exception as err:  # private API or the GPU compiler failing: one line, never a crash
        problem = f"XLA could not compile the step for it ({first_line(err)})"
        raise GpuPlanError(problem) from None
    return GpuCompiled(
        device_total=stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes,
        temporaries=stats.temp_size_in_bytes,
        xla_flops=cost_analysis_flops(executable),
    )


def cost_analysis_flops(executable: Any) -> float | None:
    """XLA's FLOPs of a compiled executable, CPU or GPU; None where it gives no cost analysis."""
    try:
        cost = executable.cost_analysis()
    except Exception:  # jax 0.10's compile-only GPU executables have none
        return None
    cost = cost[0] if isinstance(cost, list) else cost
    return float((cost or {}).get("flops", 0.0))
