"""benchmarks/gpu_compile.py's programs compile for a GPU that is not here (jax's CUDA plugin, the
`gpu-plan` extra; skipped without it): the eval step and the decoder's prefill for an RTX 2080 Ti
in bf16, where jax's XLA attention asks for a bf16 dot that XLA refuses below compute capability
8.0 (the train step's own compile for that card: tests/test_plan.py)."""

import importlib

import jax
import pytest

from benchmarks._cli import repo_file
from benchmarks.gpu_compile import PROGRAMS, Case, cases
from trainer.config import load_config
from trainer.plan import gpu_target


def plugin_imports() -> bool:
    try:
        importlib.import_module("jax_cuda12_plugin")
    except ImportError:
        return False
    return True


@pytest.mark.skipif(
    not plugin_imports(), reason="needs jax's CUDA plugin: pip install '.[gpu-plan]'"
)
@pytest.mark.parametrize("program", ["eval", "prefill"])
def test_program_compiles_for_a_2080ti_in_bf16(program):
    case = Case("rtx2080ti", "bf16", program)
    config = load_config(repo_file("configs/tiny.yaml"), case.overrides())
    compile_bytes = PROGRAMS[program](config, jax.devices("cpu")[:1], gpu_target(case.gpu, 1))
    assert compile_bytes > 0  # XLA's buffer assignment for one device


def test_survey_compiles_each_train_step_with_and_without_dropout():
    """Dropout picks another attention kernel, so the train step is surveyed with and without;
    the eval step and the decoder never apply it."""
    listed = cases(["t4"], ["fp16"])
    assert [(c.program, c.dropout) for c in listed] == [
        ("train packed", 0.0),
        ("train packed", 0.1),
        ("train one-doc", 0.0),
        ("train one-doc", 0.1),
        ("eval", 0.0),
        ("prefill", 0.0),
        ("decode step", 0.0),
    ]
