"""Write a run's parameters as a Hugging Face Llama folder: config.json, safetensors, and the
tokenizer its dataset was prepared with (`tokenizer.json` for `hf`, `tokenizer.model` for
SentencePiece; a byte-level run has no Hugging Face tokenizer to write)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from trainer.config import config_from_dict
from trainer.errors import TrainingError
from trainer.hf.config import CONFIG_FILE, hf_config
from trainer.hf.weights import save_hf_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def write_hf_folder(out: Path, params: Any, meta: dict[str, Any]) -> Path:
    """`out` (new) holding the model of a checkpoint's `meta` with `params`."""
    config = config_from_dict(meta["config"])
    if config.model.kind != "transformer":
        raise TrainingError(
            f"--format hf exports the built-in transformer, not model.kind={config.model.kind}"
        )
    out.mkdir(parents=True)
    dtype = config.precision.params
    hf = hf_config(config.model, int(meta["vocab_size"]), dtype)
    save_hf_weights(params, out)
    copied = _copy_tokenizer(config, out)
    if copied is not None:
        hf.update(copied)
    (out / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    return out


def _copy_tokenizer(config, out: Path) -> dict[str, Any] | None:
    """The dataset's tokenizer files copied into `out`; returns the special ids they name."""
    from trainer.generate import run_tokenizer

    tokenizer = run_tokenizer(config)
    model_file = getattr(tokenizer, "model_file", None)
    if model_file is None:
        print(
            "warning: no tokenizer written (byte-level data, or the dataset folder is gone)",
            file=sys.stderr,
        )
        return None
    for name in TOKENIZER_FILES:
        if (Path(model_file).parent / name).is_file():
            shutil.copyfile(Path(model_file).parent / name, out / name)
    ids = {
        "bos_token_id": getattr(tokenizer, "bos_id", None),
        "eos_token_id": getattr(tokenizer, "eos_id", None),
    }
    return {key: value for key, value in ids.items() if value is not None}
