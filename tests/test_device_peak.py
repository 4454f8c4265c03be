"""The peak a run's MFU divides by: one table, read by the run and by the GPU plan."""

import pytest

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
