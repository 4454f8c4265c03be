"""Does every program the trainer runs on a GPU compile for every GPU the plan knows? A
compile-only survey, no GPU needed: XLA's GPU compiler (jax's CUDA plugin, the `gpu-plan` extra)
compiles each program for a described GPU (`trainer.plan.gpu`), and one line per case says
`compiled` with the seconds it took and XLA's bytes per device, or `refused` with why. Exit 0:
every case compiled; 1: some were refused; 2: bad input, or no CUDA plugin here.

Programs: the train step on packed rows and on rows of one document each, with dropout 0 and
0.1 (`trainer.plan.measure`); the eval step; the key/value-cache decoder
(`trainer.models.decode`) on a prompt of several tokens (prefill) and on one token (the
generation loop's step).

    python benchmarks/gpu_compile.py [--config configs/tiny.yaml] [--gpus t4,h100]
                                     [--precisions bf16,fp16,fp32]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

if not __package__:  # run as `python benchmarks/gpu_compile.py`; tests import its programs
    import _repo_root  # noqa: F401  (before any project import: see its docstring)

import jax
import jax.numpy as jnp

from benchmarks._cli import USAGE_EXIT, repo_file, run_main
from trainer.config import Config, load_config
from trainer.errors import ConfigError
from trainer.models import abstract_params, builder_for_vocab, model_spec
from trainer.parallel import sharding
from trainer.plan import Target, cpu_devices, gpu_target, measure
from trainer.plan.gpu import GPUS, GpuPlanError, compile_for_gpu, traced_for
from trainer.plan.report import format_bytes
from trainer.plan.vocab import planned_vocab
from trainer.program import build_program

PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
TRAIN_DROPOUTS = (0.0, 0.1)
PROMPT_TOKENS = 8  # the prefill's prompt
NEW_TOKENS = 24  # the decoder's cache holds the prompt and these


@dataclass(frozen=True)
class Case:
    """One line of the survey: `program` compiled for `gpu` in `precision` with `dropout`."""

    gpu: str  # a key of `GPUS`
    precision: str  # a key of `PRECISIONS`
    program: str  # a key of `PROGRAMS`
    dropout: float = 0.0

    def overrides(self) -> list[str]:
        return [f"precision.compute={PRECISIONS[self.precision]}", f"model.dropout={self.dropout}"]

    def label(self) -> str:
        dropout = f", dropout {self.dropout:g}" if self.program.startswith("train") else ""
        return f"{self.gpu} {self.precision} {self.program}{dropout}"


# ----------------------------------------------------------------------------- programs


def train_packed(config: Config, cpus: list[jax.Device], target: Target) -> int:
    """The train step on packed rows (the trainer's data): the plan's own compile."""
    return measure(config, cpus, target).total


def train_one_document(config: Config, cpus: list[jax.Device], target: Target) -> int:
    """The train step on rows of one document each, which can take cuDNN's attention."""
    return measure(config, cpus, target, one_document_per_row=True).total


def eval_step(config: Config, cpus: list[jax.Device], target: Target) -> int:
    """The eval step on a packed batch of the train step's shape, as the loop's evals run it."""
    mesh = sharding.make_mesh(config.mesh, cpus)
    with traced_for(target.gpu):
        program = build_program(config, mesh, builder_for_vocab(config, planned_vocab(config)))
        batch = program.abstract_batch(config.data.global_batch_size, config.data.seq_len)
        with jax.set_mesh(mesh):
            traced = program.eval_step.trace(program.abstract_state(), batch)
            lowered = traced.lower(lowering_platforms=("cuda",))
    return device_bytes(lowered, mesh, cpus, target)


def decoder_prefill(config: Config, cpus: list[jax.Device], target: Target) -> int:
    """The decoder on a prompt of `PROMPT_TOKENS` at position 0, into an empty cache."""
    return compiled_decoder(config, cpus, target, tokens=PROMPT_TOKENS, start=0)


def decoder_step(config: Config, cpus: list[jax.Device], target: Target) -> int:
    """The decoder on one token after the prompt: what each step of the generation loop runs."""
    return compiled_decoder(config, cpus, target, tokens=1, start=PROMPT_TOKENS)


def compiled_decoder(
    config: Config, cpus: list[jax.Device], target: Target, tokens: int, start: int
) -> int:
    """`config`'s decoder (`ModelSpec.decoder`) on `tokens` new tokens at position `start` of a
    one-row cache, compiled for `target`; the parameters as the trainer's mesh lays them out."""
    decoder = model_spec(config.model.kind).decoder
    if decoder is None:
        raise ConfigError(f"model.kind={config.model.kind} has no key/value-cache decoder")
    config = config.derive({"model.vocab_size": planned_vocab(config)})
    mesh = sharding.make_mesh(config.mesh, cpus)
    with traced_for(target.gpu):
        skeleton, params = abstract_params(config, mesh)
        model_of = lambda p: skeleton.merge(p, {})  # noqa: E731
        cache = jax.eval_shape(
            lambda p: decoder.empty_cache(model_of(p), 1, PROMPT_TOKENS + NEW_TOKENS), params
        )
        tokens_1xT = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
        step = jax.jit(lambda p, t, c: decoder.decode(model_of(p), t, jnp.int32(start), c))
        with jax.set_mesh(mesh):
            lowered = step.trace(params, tokens_1xT, cache).lower(lowering_platforms=("cuda",))
    return device_bytes(lowered, mesh, cpus, target)


def device_bytes(lowered: jax.stages.Lowered, mesh, cpus: list[jax.Device], target: Target) -> int:
    """XLA's bytes per device of `lowered` (traced on `mesh`'s CPUs) compiled for `target`."""
    gpus = list(target.devices)
    return compile_for_gpu(lowered, list(mesh.devices.flat), cpus, gpus).device_total


Program = Callable[[Config, list[jax.Device], Target], int]
PROGRAMS: dict[str, Program] = {
    "train packed": train_packed,
    "train one-doc": train_one_document,
    "eval": eval_step,
    "prefill": decoder_prefill,
    "decode step": decoder_step,
}


def cases(gpus: list[str], precisions: list[str]) -> list[Case]:
    """Every (GPU, precision, program), the train step with each of `TRAIN_DROPOUTS` (dropout
    picks another attention kernel), the rest without dropout, which they never apply."""
    return [
        Case(gpu, precision, program, dropout)
        for gpu in gpus
        for precision in precisions
        for program in PROGRAMS
        for dropout in (TRAIN_DROPOUTS if program.startswith("train") else (0.0,))
    ]


# ----------------------------------------------------------------------------- running


def run_case(path: str, case: Case, cpus: list[jax.Device]) -> tuple[bool, str]:
    """Compile one case: whether it compiled, and the line that says how it went."""
    config = load_config(path, case.overrides())
    start = time.perf_counter()
    try:
        total = PROGRAMS[case.program](config, cpus, gpu_target(case.gpu, len(cpus)))
    except GpuPlanError as err:
        return False, f"{case.label()}: refused: {err}"
    seconds = time.perf_counter() - start
    return True, f"{case.label()}: compiled in {seconds:.1f} s, {format_bytes(total)} per device"


def name_list(known: dict) -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated list of `known`'s keys."""

    def parse(text: str) -> list[str]:
        names = [name.strip().lower() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"{', '.join(unknown) or repr(text)} is not one of {', '.join(known)}"
            )
        return names

    return parse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=repo_file("configs/tiny.yaml"))
    parser.add_argument(
        "--gpus", type=name_list(GPUS), default=list(GPUS), help="default: every GPU the plan knows"
    )
    parser.add_argument(
        "--precisions", type=name_list(PRECISIONS), default=list(PRECISIONS), help="compute dtypes"
    )
    args = parser.parse_args()
    cpus = cpu_devices(1)  # before the backend starts: the CUDA plugin must not look for a GPU
    load_config(args.config, [])  # a wrong path or key is one line before any compile
    try:
        gpu_target(args.gpus[0], len(cpus))
    except GpuPlanError as err:
        print(f"error: cannot compile for a GPU here: {err}", file=sys.stderr)
        return USAGE_EXIT
    print(f"{args.config}, compiled for each GPU by XLA's GPU compiler (no GPU here)", flush=True)
    surveyed = cases(args.gpus, args.precisions)
    compiled = 0
    for case in surveyed:
        ok, line = run_case(args.config, case, cpus)
        compiled += ok
        print(line, flush=True)
    print(f"{compiled} of {len(surveyed)} cases compiled")
    return 0 if compiled == len(surveyed) else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
