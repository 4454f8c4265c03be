"""A Hugging Face folder whose weights do not match the model `model.*` describes (config.json
edited apart from its weights, or a `model.*` key from the --config file): one line naming the
tensor or the layer count, the `model.*` keys that size it, and a fix that applies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import pytest

from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.generate import load_generator
from trainer.hf.weights import load_hf_params
from trainer.models import abstract_params
from trainer.parallel.sharding import make_mesh

UNTIED = Path(__file__).parent / "fixtures" / "hf_tiny_llama"  # 2 layers, vocab 320, d 32
FIX = "unset (in the --config file too) to follow config.json, or restore the config.json"


def with_config(tmp_path: Path, **change) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(UNTIED, folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, **change}))
    return folder


@pytest.mark.parametrize("layers", [1, 3])
def test_a_layer_count_config_json_does_not_match_names_the_layers(tmp_path, layers):
    """It said 'tensor ... has shape [16, 32], the model expects [16, 32]': equal shapes."""
    folder = with_config(tmp_path, num_hidden_layers=layers)
    with pytest.raises(ConfigError) as info:
        load_generator(f"hf:{folder}", devices=jax.devices()[:1])
    message = str(info.value)
    assert message.startswith(f"hf:{folder} holds 2 layers (model.layers.N.")
    assert f"the model expects {layers}; leave model.num_layers {FIX}" in message


def test_a_vocabulary_of_another_size_names_the_keys_that_size_it(tmp_path):
    folder = with_config(tmp_path, vocab_size=400)
    with pytest.raises(ConfigError) as info:
        load_generator(f"hf:{folder}", devices=jax.devices()[:1])
    assert str(info.value) == (
        f"hf:{folder} tensor model.embed_tokens.weight has shape [320, 32], the model expects "
        f"[400, 32]; leave model.vocab_size, model.d_model {FIX} these weights came with"
    )


@pytest.mark.parametrize(
    ("override", "keys"),
    [
        ("model.num_layers=3", "model.num_layers"),
        ("model.d_ff=48", "model.d_ff, model.d_model"),
        ("model.num_kv_heads=4", "model.num_kv_heads, model.head_dim, model.d_model"),
    ],
)
def test_a_model_key_of_the_config_that_overrides_config_json_is_named(override, keys):
    """What a recipe such as configs/1b.yaml sets wins over config.json (README); the line says
    which key to leave out."""
    config = load_config(None, [f"checkpoint.init_from=hf:{UNTIED}", override])
    _, target = abstract_params(config, make_mesh(config.mesh, jax.devices()[:1]))
    with pytest.raises(ConfigError) as info:
        load_hf_params(UNTIED, target)
    assert f"; leave {keys} {FIX}" in str(info.value)


def sharded_copy(tmp_path: Path, layers: int = 2) -> Path:
    """The fixture's tensors (its layer 1 repeated up to `layers`) in one file per tensor,
    with an index, as `save_pretrained` shards a large model."""
    from safetensors.numpy import save_file
    from test_hf import tensors

    folder = with_config(tmp_path, num_hidden_layers=layers)
    (folder / "model.safetensors").unlink()
    weights = tensors(UNTIED)
    for i in range(2, layers):
        for name in [n for n in weights if n.startswith("model.layers.1.")]:
            weights[name.replace(".1.", f".{i}.", 1)] = weights[name]
    files = {name: f"model-{i + 1:05d}-of-{len(weights):05d}.safetensors" for i, name in
             enumerate(sorted(weights))}  # fmt: skip
    for name, file in files.items():
        save_file({name: weights[name]}, str(folder / file))
    index = {"metadata": {}, "weight_map": files}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_a_shard_missing_from_a_sharded_folder_is_named(tmp_path):
    """A partial download: it said 'holds 1 layers ... leave model.num_layers unset', or 'has no
    tensor ...; is it a Llama checkpoint?', depending on which shard was missing."""
    folder = sharded_copy(tmp_path)
    load_generator(f"hf:{folder}", devices=jax.devices()[:1])  # whole, it loads
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    lost = index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    (folder / lost).unlink()
    with pytest.raises(ConfigError) as info:
        load_generator(f"hf:{folder}", devices=jax.devices()[:1])
    assert str(info.value) == (
        f"hf:{folder} lacks {lost}, named by model.safetensors.index.json; download the weights "
        "again (an interrupted download leaves shards out)"
    )


def test_a_layer_missing_between_others_is_named(tmp_path):
    """Without an index to check: layers 0 and 2 are there, layer 1's q_proj is not."""
    folder = sharded_copy(tmp_path, layers=3)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]).unlink()
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(ConfigError) as info:
        load_generator(f"hf:{folder}", devices=jax.devices()[:1])
    assert str(info.value) == (
        f"hf:{folder} has no tensor model.layers.1.self_attn.q_proj.weight; download the "
        "weights again"
    )


@pytest.mark.parametrize(
    ("scaling", "lacks"),
    [
        ({"rope_scaling": {"type": "linear"}}, "linear lacks factor"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
            "llama3 lacks low_freq_factor, high_freq_factor, original_max_position_embeddings",
        ),
    ],
)
def test_a_rope_scaling_config_json_leaves_incomplete_names_the_file(tmp_path, scaling, lacks):
    """It said 'model.rope_scaling of type linear needs factor': a key the user never set,
    and no fix."""
    folder = with_config(tmp_path, **{"rope_parameters": None, **scaling})
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"checkpoint.init_from=hf:{folder}"])
    assert str(info.value) == (
        f"config.json rope scaling of type {lacks}; restore the file the model came with"
    )


def test_the_readme_finetune_recipe_takes_its_model_from_config_json(repo_root):
    """README's command used configs/1b.yaml, whose model.* keys win over config.json: a
    Llama-3.2-1B was refused (24 layers expected, 16 held)."""
    config = load_config(
        repo_root / "configs/llama_finetune.yaml", [f"checkpoint.init_from=hf:{UNTIED}"]
    )
    hf = json.loads((UNTIED / "config.json").read_text())
    model = config.model
    assert (model.num_layers, model.d_model, model.d_ff, model.vocab_size) == (
        hf["num_hidden_layers"],
        hf["hidden_size"],
        hf["intermediate_size"],
        hf["vocab_size"],
    )
