"""Whether a Hugging Face folder a run starts from tokenizes as its training data did: its
embedding rows belong to its own `tokenizer.json`, and ids of another tokenizer train silently."""

from __future__ import annotations

from pathlib import Path

from input_pipeline.tokenizers import HF_TOKENIZER_FILE, Tokenizer
from trainer.hf import hf_folder


def other_tokenizer_warning(init_from: str | None, data_tokenizer: Tokenizer | None) -> str | None:
    """One line when `checkpoint.init_from=hf:F` brings a `tokenizer.json` the training data was
    not tokenized with (byte-identical); None when they match or either is unknown."""
    folder = hf_folder(init_from)
    if folder is None or data_tokenizer is None:
        return None
    theirs = Path(folder) / HF_TOKENIZER_FILE
    if not theirs.is_file():
        return None
    ours = getattr(data_tokenizer, "model_file", None)
    if ours is not None and Path(ours).read_bytes() == theirs.read_bytes():
        return None
    return (
        f"warning: checkpoint.init_from=hf:{folder} comes with its own {HF_TOKENIZER_FILE}, but "
        f"the training data was tokenized with another ({data_tokenizer.name}): the model reads "
        f"its ids as other tokens; prepare the data with --tokenizer hf:{folder}"
    )
