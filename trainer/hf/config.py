"""A Hugging Face `config.json` <-> `model.*`: what the built-in transformer represents exactly
(Llama 2, Llama 3/3.1/3.2, Mistral without a sliding window), and a one-line error naming the
field of anything else. Both spellings of rotary settings are read: transformers 4.x
(`rope_theta`, `rope_scaling`) and 5.x (`rope_parameters`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError
from trainer.hf import hf_folder

SUPPORTED_TYPES = ("llama", "mistral")
CONFIG_FILE = "config.json"
UNSET_CONTEXT = 4096  # max_position_embeddings written for a model without model.max_seq_len
# The rope scalings the built-in transformer computes (trainer/models/rope.py), with the keys each
# needs, as config.json spells them; `model.rope_scaling` is checked against the same list.
ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
}
ROPE_KIND_KEYS = ("rope_type", "type")  # the kind's key: transformers' spelling, older configs'


def split_rope_scaling(scaling: Mapping[str, Any], where: str) -> tuple[str | None, dict[str, Any]]:
    """`(kind, other keys)` of a rope scaling, its kind under `rope_type` (transformers' spelling)
    or `type` (older configs'): every reader splits here, so none checks one kind and computes
    another. Both keys with different kinds: a one-line error naming `where`."""
    named = {key: scaling[key] for key in ROPE_KIND_KEYS if scaling.get(key) is not None}
    if len(set(named.values())) > 1:
        raise ConfigError(
            f"{where} sets rope_type={named['rope_type']!r} and type={named['type']!r}; delete the "
            "wrong one (both name the rope scaling's kind)"
        )
    others = {key: value for key, value in scaling.items() if key not in ROPE_KIND_KEYS}
    return next(iter(named.values()), None), others


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The folder's config.json, or a one-line error saying what the folder lacks."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        lacks = f"no {CONFIG_FILE} there" if Path(folder).is_dir() else "no such folder"
        raise ConfigError(
            f"checkpoint.init_from=hf:{folder}: {lacks}; point it at a local "
            "Hugging Face model folder (config.json + *.safetensors)"
        )
    fix = "restore the file the model came with (download it again)"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{path} is not valid JSON ({err.msg}, line {err.lineno}); {fix}"
        ) from None
    except (UnicodeDecodeError, OSError):
        raise ConfigError(f"{path} cannot be read as text; {fix}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} holds a {type(hf).__name__}, not a JSON object; {fix}")
    return hf


def rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling)` from either transformers' spelling; None: unscaled."""
    params = dict(_mapping(hf, "rope_parameters"))
    theta = _real("rope_theta", params.pop("rope_theta", hf.get("rope_theta")), 1e4)
    field = "rope_parameters" if params else "rope_scaling"
    scaling = params or dict(_mapping(hf, "rope_scaling"))
    kind, scaling = split_rope_scaling(scaling, f"config.json {field}")
    if kind in (None, "default"):
        return theta, None
    if kind not in ROPE_SCALING_KEYS:
        raise ConfigError(
            f"config.json rope type {kind!r} is not supported (rope_scaling.rope_type); "
            f"supported: default, {', '.join(ROPE_SCALING_KEYS)}"
        )
    if missing := [key for key in ROPE_SCALING_KEYS[kind] if scaling.get(key) is None]:
        raise ConfigError(
            f"config.json rope scaling of type {kind} lacks {', '.join(missing)}; restore the "
            "file the model came with"
        )
    return theta, {"type": kind, **scaling}


def _mapping(hf: dict[str, Any], field: str) -> dict[str, Any]:
    """An object field of config.json ({} when absent or null)."""
    value = hf.get(field) or {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"config.json {field}={value!r} is not a JSON object; restore the file the model "
            "came with"
        )
    return value


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
        and _whole(hf, "sliding_window") < _whole(hf, "max_position_embeddings", 1),
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
    heads = _whole(hf, "num_attention_heads")
    d_model = _whole(hf, "hidden_size")
    fields: dict[str, Any] = {
        "kind": "transformer",
        "num_layers": _whole(hf, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": _whole(hf, "num_key_value_heads", heads),
        "d_model": d_model,
        "d_ff": _whole(hf, "intermediate_size"),
        "vocab_size": _whole(hf, "vocab_size"),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": _real("rms_norm_eps", hf.get("rms_norm_eps"), 1e-6),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "head_dim": _whole(hf, "head_dim", d_model // heads),
    }
    if hf.get("max_position_embeddings"):
        fields["max_seq_len"] = _whole(hf, "max_position_embeddings")
    return fields


# The `model.*` keys `model_fields` sets (max_seq_len where config.json has it).
MODEL_KEYS = (
    "kind", "num_layers", "num_heads", "num_kv_heads", "d_model", "d_ff", "vocab_size",
    "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings", "head_dim", "max_seq_len",
)  # fmt: skip


def _whole(hf: dict[str, Any], field: str, default: int | None = None) -> int:
    """A positive whole-number field of config.json (None or absent: `default`, if given)."""
    value = hf.get(field)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "missing" if value is None else f"{value!r}, not a positive whole number"
        raise ConfigError(
            f"config.json {field} is {what}; a Llama config.json sets it (restore the file "
            "the model came with)"
        )
    return value


def _real(field: str, value: Any, default: float) -> float:
    """A positive finite number field of config.json, `default` when absent or null."""
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(
            f"config.json {field}={value!r} is not a positive finite number; restore the file the "
            "model came with"
        )
    return float(value)


def fill_model_section(tree: dict[str, Any]) -> dict[str, Any]:
    """With `checkpoint.init_from=hf:PATH`, unset `model.*` keys come from its config.json; a
    config that sets them all (a run's saved config, read by export and generate) does not need
    the folder any more."""
    checkpoint = tree.get("checkpoint")
    init_from = checkpoint.get("init_from") if isinstance(checkpoint, dict) else None
    folder = hf_folder(init_from if isinstance(init_from, str) else None)
    model = tree.get("model", {})
    if folder is None or not isinstance(model, dict):
        return tree  # not an import, or a malformed section the schema reports
    if all(key in model for key in MODEL_KEYS):
        return tree
    return {**tree, "model": {**model_fields(read_hf_config(folder)), **model}}


def hf_config(model: Any, vocab_size: int, dtype: str = "float32") -> dict[str, Any]:
    """A Llama config.json for the built-in transformer's `model.*` (transformers 4.x spelling,
    which 5.x reads too)."""
    scaling = None
    if model.rope_scaling:
        kind, params = split_rope_scaling(model.rope_scaling, "model.rope_scaling")
        scaling = {**params, "rope_type": kind}
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
        "max_position_embeddings": model.max_seq_len or UNSET_CONTEXT,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
