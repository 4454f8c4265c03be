"""Export parameters: `python -m trainer.export --workdir W [--step N] --out DIR` writes a
parameters-only checkpoint that plain Orbax reads without this project's code:

    import orbax.checkpoint as ocp
    params = ocp.StandardCheckpointer().restore(DIR)   # nested dict of arrays
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
from trainer.config import config_from_dict
from trainer.errors import ConfigError, TrainingError


def export_params(workdir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Read the run's own saved config and checkpoint; write host numpy params to `out`."""
    checkpointer, latest = Checkpointer.open_existing(workdir)
    try:
        step = latest if step is None else step
        if step not in checkpointer.manager.all_steps():
            raise TrainingError(
                f"{checkpointer.directory} has no step {step}; saved steps: "
                f"{sorted(checkpointer.manager.all_steps())}"
            )
        meta = checkpointer.read_meta(step)
        config = config_from_dict(meta["config"])
        config.model.vocab_size = meta["vocab_size"]
        params = checkpointer.restore_params(step, _abstract_params(config))
    finally:
        checkpointer.close()
    out = Path(out).absolute()
    if out.exists():
        raise TrainingError(f"{out} already exists; choose a new --out folder")
    host_params = jax.tree.map(np.asarray, params)
    checkpointer_out = ocp.StandardCheckpointer()
    checkpointer_out.save(out, host_params)
    checkpointer_out.wait_until_finished()
    return out


def _abstract_params(config):
    """Parameter shapes of the saved run's model, laid out on this machine's devices."""
    from trainer import sharding
    from trainer.program import build_program
    from trainer.train import builder_for_vocab

    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
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
    args = parser.parse_args(argv)
    try:
        out = export_params(args.workdir, args.out, args.step)
    except (ConfigError, DataError, TrainingError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported parameters to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
