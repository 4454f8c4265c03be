"""`python -m trainer.export --format hf` of a run whose `model.max_seq_len` is unset: the
folder's config.json must still describe the context the run trained at, so that the project's
own import (`checkpoint.init_from=hf:`) takes the run's `data.seq_len` again."""

from __future__ import annotations

import json

from trainer.config import load_config
from trainer.export import _covering_context
from trainer.hf.config import UNSET_CONTEXT, hf_config

LONG = 4160  # past the 4096 written when model.max_seq_len is unset


def exported_context(tmp_path, seq_len: int) -> int:
    """max_position_embeddings of the config.json an export of this run writes."""
    config = _covering_context(load_config(None, [f"data.seq_len={seq_len}"]))
    hf = hf_config(config.model, 256)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return hf["max_position_embeddings"]


def test_an_export_covers_the_context_the_run_trained_at(tmp_path):
    """It wrote max_position_embeddings=4096, and re-importing the export at the run's own
    data.seq_len was refused: 'data.seq_len=4160 is longer than model.max_seq_len=4096'."""
    assert exported_context(tmp_path, LONG) == LONG
    again = load_config(None, [f"checkpoint.init_from=hf:{tmp_path}", f"data.seq_len={LONG}"])
    assert again.model.max_seq_len == LONG


def test_a_short_run_still_exports_the_usual_4096(tmp_path):
    assert exported_context(tmp_path, 64) == UNSET_CONTEXT == 4096
