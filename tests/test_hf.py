"""Hugging Face checkpoints in and out (`trainer/hf/`), and generation with a KV cache
(`trainer/generate.py`), against fixtures written by the real `transformers` library
(tests/fixtures/make_hf_fixture.py says how they were made)."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SHARED_SCHEDULE, TINY
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from trainer.config import config_from_dict, load_config
from trainer.errors import ConfigError
from trainer.export import export_params
from trainer.generate import load_generator, sample
from trainer.hf.config import hf_config, model_fields
from trainer.hf.weights import SAFETENSORS_INDEX, load_hf_params, save_hf_weights
from trainer.models import builder_for_vocab, model_spec
from trainer.parallel.sharding import make_mesh
from trainer.program import build_program
from trainer.train import init_from, run

FIXTURES = Path(__file__).parent / "fixtures"
UNTIED = FIXTURES / "hf_tiny_llama"  # GQA, llama3 rope scaling, norm eps 1e-5, tokenizer
TIED = FIXTURES / "hf_tiny_llama_tied"  # tied embeddings, explicit head_dim


def tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("fixture", [UNTIED, TIED], ids=["untied_gqa", "tied_head_dim"])
def test_imported_weights_give_the_reference_logits(fixture):
    reference = np.load(fixture / "reference.npz")
    generator = load_generator(f"hf:{fixture}", compute="float32", devices=jax.devices()[:4])
    assert generator.mesh.shape["fsdp"] == 4  # each host reads only its weight shards
    logits = generator.model({"inputs": jnp.asarray(reference["input_ids"])})
    np.testing.assert_allclose(np.asarray(logits), reference["logits"], atol=1e-5, rtol=0)


def test_import_reads_each_shard_into_a_stage_fsdp_tensor_layout():
    overrides = [
        f"checkpoint.init_from=hf:{UNTIED}",
        "mesh.stage=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
    ]
    config = load_config(None, overrides)
    program = build_program(config, make_mesh(config.mesh), builder_for_vocab(config))
    params = load_hf_params(UNTIED, program.abstract_state().params)
    original = tensors(UNTIED)
    q = params["blocks"]["attn"]["q"]["kernel"]
    assert q.sharding.spec == P("stage", "fsdp", "tensor")
    np.testing.assert_array_equal(q[1], original["model.layers.1.self_attn.q_proj.weight"].T)
    head = params["lm_head"]["kernel"]
    np.testing.assert_array_equal(head, original["lm_head.weight"].T)
    embed = params["embed"]["embedding"]
    np.testing.assert_array_equal(embed, original["model.embed_tokens.weight"])


def hf_copy_without_weights(folder: Path) -> Path:
    """A new folder with UNTIED's config and tokenizer files, for weights written next."""
    folder.mkdir()
    for file in UNTIED.iterdir():
        if file.suffix == ".json":
            shutil.copyfile(file, folder / file.name)
    return folder


def test_an_export_split_into_shards_reads_back_as_the_whole_one(tmp_path):
    """`save_hf_weights` above `max_shard_bytes`: several files and an index naming, for every
    tensor, the file that holds it; read back by safetensors and by `checkpoint.init_from`,
    the same numbers as the one-file export."""
    overrides = [f"checkpoint.init_from=hf:{UNTIED}", "mesh.fsdp=2", "mesh.tensor=2"]
    config = load_config(None, overrides)
    program = build_program(config, make_mesh(config.mesh), builder_for_vocab(config))
    params = load_hf_params(UNTIED, program.abstract_state().params)
    whole = hf_copy_without_weights(tmp_path / "whole")
    split = hf_copy_without_weights(tmp_path / "split")
    assert save_hf_weights(params, whole) == ["model.safetensors"]
    written = tensors(whole)
    max_shard_bytes = max(a.nbytes for a in written.values())  # the biggest alone in a shard
    files = save_hf_weights(params, split, max_shard_bytes=max_shard_bytes)

    assert len(files) >= 3 and sorted(p.name for p in split.glob("*.safetensors")) == files
    index = json.loads((split / SAFETENSORS_INDEX).read_text())
    assert set(index["weight_map"]) == set(written)
    assert set(index["weight_map"].values()) == set(files)
    held = {}
    for file in files:
        with safe_open(str(split / file), framework="np") as f:
            held.update(dict.fromkeys(f.keys(), file))  # noqa: SIM118
            assert sum(f.get_tensor(n).nbytes for n in f.keys()) <= max_shard_bytes  # noqa: SIM118
    assert held == index["weight_map"]  # each tensor in exactly the file the index names
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in written.values())

    read_back, original = tensors(split), tensors(UNTIED)  # safetensors' own reader
    assert sorted(read_back) == sorted(written) == sorted(original)
    for name, array in written.items():
        assert read_back[name].dtype == array.dtype
        np.testing.assert_array_equal(read_back[name], array, err_msg=name)
        np.testing.assert_array_equal(array, original[name], err_msg=name)

    def started_from(folder: Path) -> list[np.ndarray]:
        config = load_config(None, [f"checkpoint.init_from=hf:{folder}", *overrides[1:]])
        program = build_program(config, make_mesh(config.mesh), builder_for_vocab(config))
        state = init_from(config.checkpoint.init_from, program, model_spec(config.model.kind))
        return [np.asarray(leaf) for leaf in jax.tree.leaves(state.params)]

    exported = [np.asarray(leaf) for leaf in jax.tree.leaves(params)]
    for a, b, c in zip(started_from(split), started_from(whole), exported, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_config_json_of_transformers_4_and_5_read_alike():
    v5 = json.loads((UNTIED / "config.json").read_text())
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    scaling = dict(v5["rope_parameters"])
    v4["rope_theta"] = scaling.pop("rope_theta")
    v4["rope_scaling"] = {**scaling, "type": scaling.pop("rope_type")}
    assert model_fields(v4) == model_fields(v5)
    assert model_fields(v5)["rope_scaling"]["type"] == "llama3"
    assert model_fields(v5)["norm_eps"] == 1e-5


@pytest.mark.parametrize("fixture", [UNTIED, TIED], ids=["untied_gqa", "tied_head_dim"])
def test_written_config_json_reads_back_the_same_model(fixture):
    config = load_config(None, [f"checkpoint.init_from=hf:{fixture}"])
    written = hf_config(config.model, config.model.vocab_size)
    assert model_fields(written) == model_fields(json.loads((fixture / "config.json").read_text()))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "qwen2"}, "model_type='qwen2'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"sliding_window": 4096, "max_position_embeddings": 32768}, "sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
    ],
)
def test_unsupported_architectures_name_the_field(change, field):
    hf = {**json.loads((UNTIED / "config.json").read_text()), **change}
    with pytest.raises(ConfigError, match=field):
        model_fields(hf)


def test_model_section_follows_config_json_unless_overridden():
    config = load_config(None, [f"checkpoint.init_from=hf:{TIED}", "model.remat=full"])
    assert (config.model.head_dim, config.model.tie_embeddings, config.model.remat) == (
        16,
        True,
        "full",
    )
    assert (
        load_config(
            None, [f"checkpoint.init_from=hf:{TIED}", "model.num_layers=3"]
        ).model.num_layers
        == 3
    )


def damaged_copy(tmp_path: Path, damage) -> Path:
    """A copy of the untied fixture folder that `damage(folder)` then breaks."""
    folder = tmp_path / "model"
    shutil.copytree(UNTIED, folder)
    damage(folder)
    return folder


def edit_config(change):
    def damage(folder):
        hf = json.loads((folder / "config.json").read_text())
        hf.update(change)
        hf = {k: v for k, v in hf.items() if v is not DELETE}
        (folder / "config.json").write_text(json.dumps(hf))

    return damage


DELETE = object()


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda f: (f / "config.json").write_text("[1, 2]"), "holds a list, not a JSON object"),
        (lambda f: (f / "config.json").write_bytes(b"\xf7\x00\x9c"), "cannot be read as text"),
        (lambda f: (f / "config.json").write_text("{oops"), "is not valid JSON (Expecting"),
        (edit_config({"hidden_size": DELETE}), "config.json hidden_size is missing"),
        (edit_config({"num_hidden_layers": "two"}), "num_hidden_layers is 'two', not a positive"),
        (edit_config({"rope_parameters": [8.0]}), "rope_parameters=[8.0] is not a JSON object"),
        (edit_config({"rope_parameters": {"rope_theta": "big"}}), "rope_theta='big' is not a"),
        (edit_config({"rms_norm_eps": float("inf")}), "rms_norm_eps=inf is not a positive finite"),
    ],
    ids=["list", "binary", "bad_json", "no_hidden", "text_layers", "rope_list", "rope_text", "inf"],
)
def test_damaged_config_json_is_one_line_naming_the_file_or_field(tmp_path, damage, expected):
    folder = damaged_copy(tmp_path, damage)
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"checkpoint.init_from=hf:{folder}"])
    message = str(info.value)
    assert expected in message and "\n" not in message
    assert "restore the file the model came with" in message


def test_config_json_rope_of_two_different_kinds_is_one_line_naming_both_keys(tmp_path):
    """A config.json with `rope_type: llama3` and `type: linear` imported as llama3 silently."""
    rope = json.loads((UNTIED / "config.json").read_text())["rope_parameters"]
    folder = damaged_copy(tmp_path, edit_config({"rope_parameters": {**rope, "type": "linear"}}))
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"checkpoint.init_from=hf:{folder}"])
    assert str(info.value) == (
        "config.json rope_parameters sets rope_type='llama3' and type='linear'; delete the wrong "
        "one (both name the rope scaling's kind)"
    )


def test_config_json_rope_kind_under_both_keys_alike_reads_as_one():
    hf = json.loads((UNTIED / "config.json").read_text())
    both = {**hf, "rope_parameters": {**hf["rope_parameters"], "type": "llama3"}}
    assert model_fields(both) == model_fields(hf)
    config = config_from_dict({"model": model_fields(both)})
    assert hf_config(config.model, 64)["rope_scaling"]["rope_type"] == "llama3"


@pytest.mark.parametrize("size", [5, 20_000], ids=["header_cut", "tensors_cut"])
def test_truncated_safetensors_is_one_line_naming_the_file(tmp_path, size):
    folder = damaged_copy(tmp_path, lambda f: os.truncate(f / "model.safetensors", size))
    with pytest.raises(ConfigError) as info:
        load_generator(f"hf:{folder}", devices=jax.devices()[:1])
    message = str(info.value)
    assert message.startswith(f"{folder / 'model.safetensors'} is damaged or truncated (")
    assert message.endswith("); download the weights again") and "\n" not in message


def test_a_saved_config_no_longer_needs_the_hf_folder(tmp_path):
    """A run started from hf:PATH saves every model.* key, so export and generate rebuild its
    model from the saved config after the folder has moved."""
    folder = damaged_copy(tmp_path, lambda f: None)
    config = load_config(None, [f"checkpoint.init_from=hf:{folder}"])
    saved = config.to_dict()  # what a checkpoint's meta holds
    shutil.rmtree(folder)
    assert config_from_dict(saved) == config
    with pytest.raises(ConfigError, match="no such folder; point it at a local Hugging Face"):
        load_config(None, [f"checkpoint.init_from=hf:{folder}"])


def test_sampling_cuts_to_the_top_tokens():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0]])
    key = jax.random.key(0)
    assert int(sample(logits, key, 0.0, None, 1.0)[0]) == 1  # greedy
    assert int(sample(logits, key, 1.0, 1, 1.0)[0]) == 1  # top-k 1
    assert int(sample(logits, key, 1.0, None, 0.01)[0]) == 1  # nucleus of one token
    draws = sample(jnp.tile(logits, (64, 1)), key, 5.0, 2, 1.0)  # 64 independent rows
    assert set(np.asarray(draws).tolist()) == {1, 3}


@pytest.mark.parametrize("num_devices", [1, 8])
def test_greedy_generation_with_cache_equals_full_model_argmax(num_devices):
    generator = load_generator(
        f"hf:{UNTIED}", compute="float32", devices=jax.devices()[:num_devices]
    )
    assert generator.mesh.size == num_devices
    generator.eos_id = None  # compare all 32 tokens
    prompt = np.load(UNTIED / "reference.npz")["input_ids"][0, :5].tolist()
    cached = generator.generate(prompt, max_new_tokens=32, temperature=0.0)
    # no cache: the whole sequence through the training forward pass, one token at a time
    # (padded to one length: causal attention keeps the padding out of earlier positions)
    forward = jax.jit(lambda ids: generator.model({"inputs": ids}))
    ids = np.zeros((1, len(prompt) + 32), np.int32)
    ids[0, : len(prompt)] = prompt
    with jax.set_mesh(generator.mesh):
        for t in range(len(prompt), len(prompt) + 32):
            ids[0, t] = int(jnp.argmax(forward(jnp.asarray(ids))[0, t - 1]))
    np.testing.assert_array_equal(cached, ids[0, len(prompt) :])


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A dataset tokenized with the fixture's tokenizer.json, and a run started from its weights:
    4 steps, checkpoints at 2 and 4, a greedy sample of one prompt at the final eval."""
    from input_pipeline.prepare import prepare_dataset

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(errors="replace") for f in sorted(stdlib.glob("*.py"))[:30]]
    root = tmp_path_factory.mktemp("hf_run")
    data = prepare_dataset(texts, root / "data", tokenizer=f"hf:{UNTIED}", progress=False)
    shape_free = [o for o in TINY if not o.startswith("model.")]
    overrides = shape_free + [
        f"data.path={data}",
        f"run.workdir={root / 'work'}",
        f"checkpoint.init_from=hf:{UNTIED}",
        "checkpoint.every=2",
        SHARED_SCHEDULE,  # its resume to step 6 compiles nothing new
        "eval.every=100",
        "eval.sample_prompts=['def ']",
        "eval.sample_tokens=4",
    ]
    result = run(load_config(None, [*overrides, "run.steps=4"]))
    return root, data, overrides, result


@pytest.mark.slow
def test_prepare_records_the_hf_tokenizer(hf_run):
    _, data, _, _ = hf_run
    spec = json.loads((data / "dataset.json").read_text())["tokenizer"]
    assert (spec["kind"], spec["vocab_size"], spec["model"]) == ("hf", 320, "tokenizer.json")
    assert (data / "tokenizer.json").read_bytes() == (UNTIED / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_run_from_hf_trains_and_resumes_from_its_own_checkpoints(hf_run, capfd):
    root, _, overrides, first = hf_run
    assert first.step == 4 and np.isfinite(first.last_metrics["loss"])
    resumed = run(load_config(None, [*overrides, "run.steps=6"]))
    assert resumed.step == 6
    assert "(step 4)" in capfd.readouterr().err  # resumed from its own step 4, not re-imported
    samples = [json.loads(line) for line in (root / "work" / "samples.jsonl").open()]
    assert [(s["step"], s["prompt"]) for s in samples] == [(4, "def "), (6, "def ")]
    assert all(isinstance(s["text"], str) and s["text"] for s in samples)


@pytest.mark.slow
def test_export_then_import_is_the_identity(hf_run, tmp_path):
    root, _, _, _ = hf_run
    out = export_params(root / "work", tmp_path / "hf", step=4, format="hf")
    exported, original = tensors(out), tensors(UNTIED)
    layout = lambda ts: {n: (a.shape, a.dtype) for n, a in ts.items()}  # noqa: E731
    assert layout(exported) == layout(original)
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).is_file()
    config = json.loads((out / "config.json").read_text())
    assert model_fields(config) == {
        **model_fields(json.loads((UNTIED / "config.json").read_text()))
    }
    # re-import: the same parameters as the run's checkpoint of step 4
    again = load_generator(f"hf:{out}", devices=jax.devices()[:2])
    saved = load_generator(str(root / "work"), step=4, devices=jax.devices()[:2])
    from flax import nnx

    flat = lambda m: jax.tree.leaves(nnx.to_pure_dict(nnx.state(m, nnx.Param)))  # noqa: E731
    for a, b in zip(flat(again.model), flat(saved.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(exported[n], original[n]) for n in original)  # it trained


@pytest.mark.slow
def test_a_start_from_hf_on_data_of_another_tokenizer_warns_once(hf_run, corpus, tmp_path, capfd):
    """Byte-level data fed to a model whose embedding rows belong to its tokenizer.json trained
    without a word; the data prepared with that tokenizer.json (hf_run's) gets no warning."""
    from input_pipeline.tokenizers import get_tokenizer
    from trainer.hf.tokenizer import other_tokenizer_warning

    _, data, _, _ = hf_run
    spec = json.loads((data / "dataset.json").read_text())["tokenizer"]
    assert other_tokenizer_warning(f"hf:{UNTIED}", get_tokenizer(spec, data)) is None

    shape_free = [o for o in TINY if not o.startswith("model.")]
    args = [f"data.path={corpus}", f"run.workdir={tmp_path}", f"checkpoint.init_from=hf:{UNTIED}"]
    run(load_config(None, [*shape_free, *args, "run.steps=1", "eval.every=100"]))
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning:" in line]
    assert warnings == [
        f"warning: checkpoint.init_from=hf:{UNTIED} comes with its own tokenizer.json, but the "
        "training data was tokenized with another (byte): the model reads its ids as other "
        f"tokens; prepare the data with --tokenizer hf:{UNTIED}"
    ]
