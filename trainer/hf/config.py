"""A Hugging Face `config.json` <-> `model.*`: what the built-in transformer represents exactly
(Llama 2, Llama 3/3.1/3.2, Mistral without a sliding window), and a one-line error naming the
field of anything else. Both spellings of rotary settings are read: transformers 4.x
(`rope_theta`, `rope_scaling`) and 5.x (`rope_parameters`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError
from trainer.hf import hf_folder

SUPPORTED_TYPES = ("llama", "mistral")
CONFIG_FILE = "config.json"


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The folder's config.json, or a one-line error saying what the folder lacks."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            f"checkpoint.init_from=hf:{folder}: no {CONFIG_FILE} there; point it at a local "
            "Hugging Face model folder (config.json + *.safetensors)"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err.msg}, line {err.lineno})") from None


def rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling)` from either transformers' spelling; None: unscaled."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = params or dict(hf.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ConfigError(
            f"config.json rope type {kind!r} is not supported (rope_scaling.rope_type); "
            "supported: default, linear, llama3"
        )
    return theta, {"type": kind, **scaling}


def check_supported(hf: dict[str, Any]) -> None:
    """One line naming the first field the built-in transformer cannot represent."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise ConfigError(
            f"config.json model_type={model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TYPES)} (Llama-architecture checkpoints)"
        )
    problems = {
        "attention_bias": bool(hf.get("attention_bias")),
        "mlp_bias": bool(hf.get("mlp_bias")),
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        # a window as long as the context changes nothing
        "sliding_window": hf.get("sliding_window") is not None
        and hf["sliding_window"] < hf.get("max_position_embeddings", 0),
    }
    for field, unsupported in problems.items():
        if unsupported:
            raise ConfigError(
                f"config.json {field}={hf.get(field)!r} is not supported by the built-in "
                "transformer; only Llama-architecture checkpoints import exactly"
            )


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The `model.*` values that reproduce a checkpoint's architecture."""
    check_supported(hf)
    theta, scaling = rope_settings(hf)
    heads = int(hf["num_attention_heads"])
    fields: dict[str, Any] = {
        "kind": "transformer",
        "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "d_model": int(hf["hidden_size"]),
        "d_ff": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
    }
    if hf.get("max_position_embeddings"):
        fields["max_seq_len"] = int(hf["max_position_embeddings"])
    return fields


def fill_model_section(tree: dict[str, Any]) -> dict[str, Any]:
    """With `checkpoint.init_from=hf:PATH`, unset `model.*` keys come from its config.json."""
    checkpoint = tree.get("checkpoint")
    init_from = checkpoint.get("init_from") if isinstance(checkpoint, dict) else None
    folder = hf_folder(init_from if isinstance(init_from, str) else None)
    model = tree.get("model", {})
    if folder is None or not isinstance(model, dict):
        return tree  # not an import, or a malformed section the schema reports
    return {**tree, "model": {**model_fields(read_hf_config(folder)), **model}}


def hf_config(model: Any, vocab_size: int, dtype: str = "float32") -> dict[str, Any]:
    """A Llama config.json for the built-in transformer's `model.*` (transformers 4.x spelling,
    which 5.x reads too)."""
    scaling = dict(model.rope_scaling) if model.rope_scaling else None
    if scaling is not None:
        scaling["rope_type"] = scaling.pop("type", None) or scaling.pop("rope_type")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.d_ff,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads or model.num_heads,
        "head_dim": model.head_dim or model.d_model // model.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len or 4096,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
