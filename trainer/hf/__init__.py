"""Hugging Face Llama-family checkpoints in and out: `checkpoint.init_from=hf:PATH` reads a local
folder (`config.json` + `*.safetensors`), `python -m trainer.export --format hf` writes one.

`config` maps config.json to `model.*` (no JAX import: the config loader uses it); `weights` maps
tensor names and reads each tensor straight into its sharded layout.
"""

HF_PREFIX = "hf:"


def hf_folder(init_from: str | None) -> str | None:
    """The folder of an `hf:PATH` reference, or None for anything else (e.g. a workdir)."""
    if init_from and init_from.startswith(HF_PREFIX):
        return init_from[len(HF_PREFIX) :]
    return None
