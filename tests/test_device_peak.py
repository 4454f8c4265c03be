"""The device facts a run reports by: the peak its MFU divides by (one table, read by the run
and by the GPU plan), and a precision the GPU has no tensor cores for."""

from types import SimpleNamespace

import pytest

from trainer.models.attention import precision_warning
from trainer.observe.flops import peak_tflops_of
from trainer.plan.gpu import GPUS


@pytest.mark.parametrize(
    ("device_kind", "tflops"),
    [
        ("NVIDIA GeForce RTX 2080 Ti", 53.8),  # fp16: Turing has no bf16
        ("Tesla T4", 65.0),
        ("Tesla V100-SXM2-16GB", 125.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GeForce RTX 4090", 165.0),
        ("NVIDIA A100-SXM4-40GB", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("TPU v5 lite", 197.0),
        ("TPU v5", 459.0),
        ("TPU v5p", 459.0),
        ("TPU v6 lite", 918.0),
        ("cpu", None),
        ("NVIDIA GeForce RTX 3080", None),  # not "rtx 3090", nor any name inside another word
    ],
)
def test_a_device_kind_reads_its_own_peak(device_kind, tflops):
    assert peak_tflops_of(device_kind) == tflops


def test_every_gpu_the_plan_knows_has_the_peak_a_run_reports_mfu_with():
    """A run on any GPU `python -m trainer.plan --gpu` knows reports `mfu`: the plan's GPU
    descriptions are the device kinds JAX reports, and the plan's rates use the same peak."""
    for name, gpu in GPUS.items():
        peak = peak_tflops_of(gpu.description)
        assert peak is not None, name
        assert gpu.rates().flops == pytest.approx(peak * 1e12), name


def gpu(kind: str, capability: str) -> SimpleNamespace:
    """A stand-in for a CUDA `jax.Device`: the fields the precision check reads."""
    return SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=capability)


@pytest.mark.parametrize(
    ("compute", "device", "warns"),
    [
        ("bfloat16", gpu("NVIDIA GeForce RTX 2080 Ti", "7.5"), True),
        ("bfloat16", gpu("Tesla V100-SXM2-16GB", "7.0"), True),
        ("float16", gpu("NVIDIA GeForce RTX 2080 Ti", "7.5"), False),
        ("float32", gpu("Tesla T4", "7.5"), False),
        ("bfloat16", gpu("NVIDIA A100-SXM4-80GB", "8.0"), False),
        ("bfloat16", gpu("NVIDIA B200", "10.0"), False),
        ("bfloat16", SimpleNamespace(platform="cpu", device_kind="cpu"), False),
        ("bfloat16", SimpleNamespace(platform="tpu", device_kind="TPU v4"), False),
    ],
)
def test_bf16_on_a_gpu_without_bf16_tensor_cores_is_named(compute, device, warns):
    """The default precision on the RTX 2080 Ti runs its matmuls without tensor cores: said at
    the start of the run, with the setting that uses them."""
    line = precision_warning(compute, device)
    if not warns:
        assert line is None
        return
    assert line == (
        f"warning: precision.compute=bfloat16 on {device.device_kind} (compute capability "
        f"{device.compute_capability}), which has no bf16 tensor cores: its matmuls run at fp32 "
        "speed or slower; set precision.compute=float16 for its tensor cores (its loss is scaled "
        "for you)"
    )
