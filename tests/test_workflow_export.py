"""The last steps of a user's workflow: `trainer.export` names the step it exported (after
requeues and damaged checkpoints skipped, "the latest" is not obvious), and the Hugging Face
folder it writes is readable by whoever may read the folder's other files (a shared models
folder)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from conftest import tiny_run

from trainer.config import load_config
from trainer.export import main as export_main
from trainer.hf.weights import load_hf_params, save_hf_weights
from trainer.models import builder_for_vocab
from trainer.parallel.sharding import make_mesh
from trainer.program import build_program
from trainer.train import run

UNTIED = Path(__file__).parent / "fixtures" / "hf_tiny_llama"


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_exported_safetensors_get_the_umask_mode_like_the_other_files(tmp_path):
    """safetensors writes its files owner-only (0600): the config.json and tokenizer beside
    them were readable by the group and others, the weights not."""
    config = load_config(None, [f"checkpoint.init_from=hf:{UNTIED}"])
    program = build_program(config, make_mesh(config.mesh), builder_for_vocab(config))
    params = load_hf_params(UNTIED, program.abstract_state().params)
    umask = os.umask(0o022)
    try:
        whole, split = tmp_path / "whole", tmp_path / "split"
        whole.mkdir()
        split.mkdir()
        files = [whole / f for f in save_hf_weights(params, whole)]
        files += [split / f for f in save_hf_weights(params, split, max_shard_bytes=2**14)]
        (whole / "config.json").write_text("{}")
    finally:
        os.umask(umask)
    assert len(files) > 2
    assert {f.name: mode_of(f) for f in files} == dict.fromkeys((f.name for f in files), 0o644)
    assert mode_of(whole / "config.json") == 0o644


def test_the_export_line_names_the_step_and_the_format(corpus, tmp_path, capsys):
    """It said `exported parameters to DIR`: which checkpoint, and that it is a Hugging Face
    folder, went unsaid."""
    workdir = tmp_path / "run"
    run(tiny_run(corpus, workdir, steps=2))
    capsys.readouterr()
    out = tmp_path / "hf"
    assert export_main(["--workdir", str(workdir), "--format", "hf", "--out", str(out)]) == 0
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"exported step 2 of {workdir} to {out} (a Hugging Face folder)"
