"""Export parameters: `python -m trainer.export --workdir W [--step N] --out DIR` writes a
parameters-only checkpoint that plain Orbax reads without this project's code:

    import orbax.checkpoint as ocp
    params = ocp.StandardCheckpointer().restore(DIR)   # nested dict of arrays

With `--format hf`, DIR is a Hugging Face Llama folder (config.json, safetensors, tokenizer) that
`transformers.LlamaForCausalLM.from_pretrained(DIR)` loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from input_pipeline.errors import DataError
from trainer.checkpoint import Checkpointer
from trainer.errors import ConfigError, TrainingError


def export_params(
    workdir: str | Path, out: str | Path, step: int | None = None, format: str = "orbax"
) -> Path:
    """Read the run's own saved config and checkpoint; write host numpy params to `out` (or, with
    `format="hf"`, a Hugging Face Llama folder: `trainer/hf/export.py`)."""
    checkpointer, _ = Checkpointer.open_existing(workdir)
    try:
        restored, params = checkpointer.restore_chosen(
            step,
            lambda step: _restore_params(checkpointer, step),
            advice="repair it, or export another --step",
        )
        meta = checkpointer.read_meta(restored)
    finally:
        checkpointer.close()
    out = Path(out).absolute()
    if out.exists():
        raise TrainingError(f"{out} already exists; choose a new --out folder")
    if format == "hf":
        from trainer.hf.export import write_hf_folder

        return write_hf_folder(out, params, meta)
    host_params = jax.tree.map(np.asarray, params)
    checkpointer_out = ocp.StandardCheckpointer()
    checkpointer_out.save(out, host_params)
    checkpointer_out.wait_until_finished()
    return out


def _restore_params(checkpointer: Checkpointer, step: int):
    """The parameters of `step`, shaped by the model config saved with it."""
    return checkpointer.restore_params(step, _abstract_params(checkpointer.run_config(step)))


def _abstract_params(config):
    """Parameter shapes of the saved run's model, laid out on this machine's devices."""
    from trainer.parallel import sharding
    from trainer.parallel.program import build_program
    from trainer.train import builder_for_vocab

    config.mesh.stage, config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, -1, 1, 1
    mesh = sharding.make_mesh(config.mesh)
    return build_program(config, mesh, builder_for_vocab(config)).abstract_state().params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workdir", required=True, help="run.workdir of the run to export")
    parser.add_argument("--step", type=int, default=None, help="default: the latest")
    parser.add_argument("--out", required=True, help="new folder for the parameters")
    parser.add_argument(
        "--format",
        choices=["orbax", "hf"],
        default="orbax",
        help="orbax (default): plain Orbax params; hf: a Hugging Face Llama folder",
    )
    args = parser.parse_args(argv)
    try:
        out = export_params(args.workdir, args.out, args.step, args.format)
    except (ConfigError, DataError, TrainingError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported parameters to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
