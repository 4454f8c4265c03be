"""`python -m trainer.generate` and `trainer.generate.sample` on inputs at the edges: a tiny
temperature, a config.json with several end-of-text ids, an hf: folder that is not there, and a
key/value cache the devices cannot hold; against the tiny Llama fixture written by `transformers`
(it has a tokenizer.json, so the CLI needs no trained run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import generate
from trainer.generate import load_generator, sample

UNTIED = Path(__file__).parent / "fixtures" / "hf_tiny_llama"


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-40, 1e-45])
@pytest.mark.parametrize(("top_k", "top_p"), [(None, 1.0), (2, 0.9)], ids=["plain", "cut"])
def test_a_tiny_temperature_samples_the_top_token(temperature, top_k, top_p):
    """logits / 1e-40 overflowed float32 to inf, and inf - inf made every draw token 0."""
    logits = jnp.asarray([[0.0, 30.0, 10.0, 20.0]] * 8)
    draws = sample(logits, jax.random.key(3), temperature, top_k, top_p)
    assert np.asarray(draws).tolist() == [1] * 8


def test_a_normal_temperature_still_samples_every_kept_token():
    logits = jnp.tile(jnp.asarray([[0.0, 3.0, 1.0, 2.0]]), (64, 1))  # 64 independent rows
    draws = sample(logits, jax.random.key(0), 5.0, 2, 1.0)
    assert set(np.asarray(draws).tolist()) == {1, 3}


def test_every_end_of_text_id_of_a_list_ends_generation(tmp_path):
    """Chat checkpoints list several ids (Llama 3.1: end of text, of a turn, of a message);
    generation stops at whichever comes first, not only at the list's first."""
    prompt = np.load(UNTIED / "reference.npz")["input_ids"][0, :5].tolist()
    free = load_generator(f"hf:{UNTIED}", compute="float32", devices=jax.devices()[:1])
    free.eos_id = None
    ids = free.generate(prompt, max_new_tokens=12, temperature=0.0).tolist()
    stop = ids[3]
    folder = tmp_path / "chat"
    shutil.copytree(UNTIED, folder)
    hf = json.loads((folder / "config.json").read_text())
    unused = next(i for i in range(hf["vocab_size"]) if i not in ids)
    hf["eos_token_id"] = [unused, stop]
    (folder / "config.json").write_text(json.dumps(hf))
    chat = load_generator(f"hf:{folder}", compute="float32", devices=jax.devices()[:1])
    assert tuple(chat.eos_id) == (unused, stop)
    cut = chat.generate(prompt, max_new_tokens=12, temperature=0.0).tolist()
    assert cut == ids[: ids.index(stop) + 1]


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("make", [lambda p: None, lambda p: p.mkdir()], ids=["none", "empty"])
def test_an_hf_folder_without_config_json_names_the_flag(tmp_path, make, capsys):
    """It named checkpoint.init_from, a config key the user of generate never set."""
    make(tmp_path / "model")
    argv = ["--workdir", f"hf:{tmp_path / 'model'}", "--prompt", "def"]
    assert generate.main(argv) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: --workdir hf:{tmp_path / 'model'}: no ")
    assert "point it at a local Hugging Face model folder" in line


def test_max_new_tokens_past_int32_positions_is_one_line(capsys):
    """It raised OverflowError from inside JAX after loading the model."""
    argv = ["--workdir", f"hf:{UNTIED}", "--prompt", "def", "--max-new-tokens", "3000000000"]
    assert generate.main(argv) == 2
    assert error_line(capsys) == (
        "error: --max-new-tokens 3000000000 is past the last position the decoder counts to "
        "(int32); pass at most 2147483647"
    )


def test_a_seed_past_64_bits_is_one_line(capsys):
    """jax.random.key raised OverflowError with a traceback after loading the model."""
    argv = ["--workdir", f"hf:{UNTIED}", "--prompt", "def", "--seed", str(10**20)]
    assert generate.main(argv) == 2
    assert error_line(capsys) == (
        f"error: --seed {10**20} does not fit in 64 bits; pass a smaller seed such as 0"
    )


def test_a_cache_larger_than_memory_is_one_line(monkeypatch, capsys):
    """A 10^7-token cache (1.2 GiB on each of the 8 CPU devices) on a host with 1 GiB left: it
    raised RESOURCE_EXHAUSTED with a traceback, or XLA:CPU aborted the process. Nothing is
    allocated here: the check comes first."""
    monkeypatch.setattr(generate, "available_memory", lambda: 2**30)
    argv = ["--workdir", f"hf:{UNTIED}", "--prompt", "def", "--max-new-tokens", "10000000"]
    assert generate.main(argv) == 2
    assert error_line(capsys) == (
        "error: a key/value cache of 10000003 positions needs 9.5 GiB, more than the devices' "
        "1.0 GiB; lower --max-new-tokens (eval.sample_tokens for samples in training) or "
        "shorten the prompt"
    )


@pytest.mark.slow
def test_a_run_of_a_model_without_a_decoder_names_the_way_out(
    corpus, tmp_path, repo_root, monkeypatch, capsys
):
    """It said 'generation needs model.kind=transformer' and no fix."""
    from conftest import tiny_run

    from trainer.train import run

    monkeypatch.syspath_prepend(str(repo_root / "examples"))
    config = tiny_run(corpus, tmp_path / "run", steps=2)
    run(config.derive({"model.kind": "parallel_block:build"}))
    capsys.readouterr()
    assert generate.main(["--workdir", str(tmp_path / "run"), "--prompt", "def"]) == 2
    assert error_line(capsys) == (
        "error: trainer.generate samples the built-in transformer, not "
        "model.kind=parallel_block:build (it has no key/value-cache decoder); export its "
        "parameters with python -m trainer.export and sample them with your model's own code"
    )


def test_decoding_stops_once_every_row_has_ended():
    """The loop ran all --max-new-tokens steps after the end-of-text id, and the output was cut
    afterwards: a short answer cost the whole budget. Now the positions after it are never
    decoded (they stay 0 in the compiled loop's output); the tokens before it are the same."""
    from flax import nnx

    prompt = np.load(UNTIED / "reference.npz")["input_ids"][0, :5].tolist()
    free = load_generator(f"hf:{UNTIED}", compute="float32", devices=jax.devices()[:1])
    free.eos_id = None
    ids = free.generate(prompt, max_new_tokens=12, temperature=0.0).tolist()
    stop = ids[3]
    first = ids.index(stop)
    assert any(ids[first + 1 :]), "the free run decodes tokens after the stop id"
    graphdef, state = nnx.split(free.model)
    run = generate._compiled(graphdef, free.decoder, free.mesh, 12, 0.0, None, 1.0, (stop,))
    with jax.set_mesh(free.mesh):
        raw = np.asarray(run(state, jnp.asarray([prompt], jnp.int32), jax.random.key(0)))[0]
    assert raw.tolist() == ids[: first + 1] + [0] * (11 - first)


def test_an_exported_sentencepiece_folder_generates_text(tmp_path, capsys):
    """`trainer.export --format hf` of a SentencePiece run writes tokenizer.model, no
    tokenizer.json; generate refused that folder ("no tokenizer") though export had written it."""
    from input_pipeline.tokenizers import train_sentencepiece

    folder = tmp_path / "exported"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(UNTIED / name, folder / name)
    lines = [f"def f{i}(x): return x * {i} + {i % 7}" for i in range(400)]
    train_sentencepiece(lines, 300, folder / "tokenizer.model")
    argv = ["--workdir", f"hf:{folder}", "--prompt", "def f1(x):", "--max-new-tokens", "4"]
    assert generate.main([*argv, "--temperature", "0", "--compute", "float32"]) == 0
    assert capsys.readouterr().out.startswith("def f1(x):")
