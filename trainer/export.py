"""Export parameters: `python -m trainer.export --workdir W [--step N] --out DIR` writes a
parameters-only checkpoint that plain Orbax reads without this project's code:

    import orbax.checkpoint as ocp
    params = ocp.StandardCheckpointer().restore(DIR)   # nested dict of arrays

With `--format hf`, DIR is a Hugging Face Llama folder that
`transformers.LlamaForCausalLM.from_pretrained(DIR)` loads: config.json, safetensors, and the
dataset's tokenizer (`tokenizer.json` for `hf`, `tokenizer.model` for SentencePiece, a byte-level
`tokenizer.json` for byte data) with a `tokenizer_config.json`, so that
`transformers.AutoTokenizer.from_pretrained(DIR)` gives the ids the training data has (no BOS or
EOS the data did not have).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from trainer.checkpoint import Checkpointer
from trainer.config import Config
from trainer.errors import USER_ERRORS, TrainingError
from trainer.generate import run_tokenizer
from trainer.hf.config import CONFIG_FILE, UNSET_CONTEXT
from trainer.hf.tokenizer import write_tokenizer
from trainer.models import abstract_params, model_spec
from trainer.models.spec import HfAdapter
from trainer.parallel import sharding


def export_params(
    workdir: str | Path, out: str | Path, step: int | None = None, format: str = "orbax"
) -> Path:
    """Read the run's own saved config and checkpoint; write host numpy params to `out` (or, with
    `format="hf"`, a Hugging Face Llama folder)."""
    return export_step(workdir, out, step, format)[0]


def export_step(
    workdir: str | Path, out: str | Path, step: int | None = None, format: str = "orbax"
) -> tuple[Path, int]:
    """`export_params`, and the step it exported: the latest that restores when `step` is None
    (a damaged newer one is skipped, with a warning)."""
    out = Path(out).absolute()
    _check_writable(out)
    exported, (config, params) = Checkpointer.restore_past_run(
        workdir,
        step,
        functools.partial(_restore_params, format=format),
        advice="repair it, or export another --step",
    )
    if format == "hf":
        return write_hf_folder(out, params, config, model_spec(config.model.kind).hf), exported
    host_params = jax.tree.map(np.asarray, params)
    checkpointer_out = ocp.StandardCheckpointer()
    checkpointer_out.save(out, host_params)
    checkpointer_out.wait_until_finished()
    return out, exported


def _check_writable(out: Path) -> None:
    """Refuse an `out` that exists or cannot be created before any weight is read (the writers
    would fail later, from their own threads)."""
    if out.exists():
        raise TrainingError(f"{out} already exists; choose a new --out folder")
    try:
        out.mkdir(parents=True)
        out.rmdir()
    except OSError as err:
        raise TrainingError(
            f"cannot create --out folder {out} ({err.strerror}); choose a writable folder"
        ) from None


def _restore_params(checkpointer: Checkpointer, step: int, format: str) -> tuple[Config, Any]:
    """The config saved with `step`, and its parameters laid out on this machine's devices; a
    kind that `format` cannot write is refused before any weight is read."""
    saved = checkpointer.run_config(step)
    if format == "hf" and model_spec(saved.model.kind).hf is None:
        raise TrainingError(
            f"--format hf exports the built-in transformer, not model.kind={saved.model.kind}; "
            "use --format orbax"
        )
    config = saved.derive({"mesh.stage": 1, "mesh.data": -1, "mesh.fsdp": 1, "mesh.tensor": 1})
    _, target = abstract_params(config, sharding.make_mesh(config.mesh))
    return saved, checkpointer.restore_params(step, target)


def write_hf_folder(out: Path, params: Any, config: Config, adapter: HfAdapter) -> Path:
    """`out` (new) holding `config`'s model (its `model.vocab_size` set) with `params`."""
    out.mkdir(parents=True)
    model = _covering_context(config).model
    hf = adapter.config_json(model, model.vocab_size, config.precision.params)
    adapter.save_weights(params, out)
    hf.update(write_tokenizer(run_tokenizer(config.data), out, hf["max_position_embeddings"]))
    (out / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    return out


def _covering_context(config: Config) -> Config:
    """`config` with a `model.max_seq_len` (config.json's max_position_embeddings) no shorter
    than the `data.seq_len` it trained at: a re-import takes max_seq_len from config.json and
    would refuse that data.seq_len."""
    if config.model.max_seq_len or config.data.seq_len <= UNSET_CONTEXT:
        return config
    return config.derive({"model.max_seq_len": config.data.seq_len})


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
        out, step = export_step(args.workdir, args.out, args.step, args.format)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    kind = "a Hugging Face folder" if args.format == "hf" else "Orbax parameters"
    print(f"exported step {step} of {args.workdir} to {out} ({kind})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
