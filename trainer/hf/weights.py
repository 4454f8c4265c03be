"""Tensor names and layouts between a Hugging Face Llama and the built-in transformer.

Ours stacks layers (`blocks/...` is `[layers, ...]`) and stores `nnx.Linear` kernels `[in, out]`,
the transpose of Hugging Face's `[out, in]` weights; nothing else differs (same rotate-half
rotary, no permutation). Import reads each tensor slice by slice straight into its sharded
layout, so a host only ever reads its own shards; export writes host copies to safetensors.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from trainer.errors import ConfigError

# our parameter path -> (Hugging Face name, stacked over layers, stored transposed)
_LAYER = "model.layers.{i}."
NAMES: dict[tuple[str, ...], tuple[str, bool, bool]] = {
    ("embed", "embedding"): ("model.embed_tokens.weight", False, False),
    ("final_norm", "scale"): ("model.norm.weight", False, False),
    ("lm_head", "kernel"): ("lm_head.weight", False, True),
    ("blocks", "attn_norm", "scale"): (_LAYER + "input_layernorm.weight", True, False),
    ("blocks", "mlp_norm", "scale"): (_LAYER + "post_attention_layernorm.weight", True, False),
    ("blocks", "attn", "q", "kernel"): (_LAYER + "self_attn.q_proj.weight", True, True),
    ("blocks", "attn", "k", "kernel"): (_LAYER + "self_attn.k_proj.weight", True, True),
    ("blocks", "attn", "v", "kernel"): (_LAYER + "self_attn.v_proj.weight", True, True),
    ("blocks", "attn", "out", "kernel"): (_LAYER + "self_attn.o_proj.weight", True, True),
    ("blocks", "mlp", "gate", "kernel"): (_LAYER + "mlp.gate_proj.weight", True, True),
    ("blocks", "mlp", "up", "kernel"): (_LAYER + "mlp.up_proj.weight", True, True),
    ("blocks", "mlp", "down", "kernel"): (_LAYER + "mlp.down_proj.weight", True, True),
}
SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 2**30  # as `save_pretrained` shards by default


def _path_of(keypath) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in keypath)


class SafetensorsFolder:
    """Every tensor of a folder's `*.safetensors` files (sharded or not), opened lazily."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"hf:{folder} has no *.safetensors files; download the weights")
        _check_index(self.folder)
        self._files = [_open_safetensors(f) for f in files]
        self._where = {name: f for f in self._files for name in f.keys()}  # noqa: SIM118

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Only the slice `index` of tensor `name` is read from disk."""
        return self._where[name].get_slice(name)[index]


def _check_index(folder: Path) -> None:
    """A sharded folder missing a file its index names (a partial download) is one line naming
    the file, not a layer count or a tensor that seems to be missing."""
    index = folder / SAFETENSORS_INDEX
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        named = sorted({str(file) for file in weight_map.values()})
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        raise ConfigError(
            f"{index} is damaged (no readable weight_map); download the weights again"
        ) from None
    missing = [name for name in named if not (folder / name).is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(
            f"hf:{folder} lacks {missing[0]}{more}, named by {SAFETENSORS_INDEX}; download the "
            "weights again (an interrupted download leaves shards out)"
        )


def _open_safetensors(path: Path) -> Any:
    """One file opened lazily; a truncated or damaged one is a one-line error naming it (the
    header is checked against the file's size on open)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="np")
    except (SafetensorError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"{path} is damaged or truncated ({reason}); download the weights again"
        ) from None


def _read_block(
    source: SafetensorsFolder, name: str, stacked: bool, transposed: bool, index, dtype
) -> np.ndarray:
    """Our array's block at `index` (a device shard), read from the matching HF slices."""
    index = tuple(index)

    def one(name: str, sub: tuple[slice, ...]) -> np.ndarray:
        block = source.read(name, sub[::-1] if transposed else sub)
        return (block.T if transposed else block).astype(dtype)

    if not stacked:
        return one(name, index)
    layers = range(*index[0].indices(_layers_of(source, name)))
    return np.stack([one(name.format(i=i), index[1:]) for i in layers])


def _layers_of(source: SafetensorsFolder, template: str) -> int:
    count = 0
    while template.format(i=count) in source:
        count += 1
    return count


def load_hf_params(folder: str | Path, target: Any) -> Any:
    """Parameters shaped like `target` (ShapeDtypeStructs with shardings), each tensor read
    shard by shard from `folder`'s safetensors into its sharded layout."""
    source = SafetensorsFolder(folder)

    def load(keypath, leaf):
        path = _path_of(keypath)
        if path not in NAMES:
            raise ConfigError(f"parameter {'/'.join(path)} has no Hugging Face counterpart")
        name, stacked, transposed = NAMES[path]
        if path == ("lm_head", "kernel") and name not in source:
            raise ConfigError(
                f"hf:{folder} has no {name} (tied embeddings); set model.tie_embeddings=true"
            )
        _check_shape(source, name, stacked, transposed, leaf.shape, folder)
        return jax.make_array_from_callback(
            leaf.shape,
            leaf.sharding,
            lambda index: _read_block(source, name, stacked, transposed, index, leaf.dtype),
        )

    return jax.tree_util.tree_map_with_path(load, target)


# the `model.*` keys that size each Hugging Face tensor (by its name's ending)
_SIZED_BY = {
    "embed_tokens.weight": "model.vocab_size, model.d_model",
    "lm_head.weight": "model.vocab_size, model.d_model",
    "norm.weight": "model.d_model",
    "layernorm.weight": "model.d_model",
    "q_proj.weight": "model.num_heads, model.head_dim, model.d_model",
    "o_proj.weight": "model.num_heads, model.head_dim, model.d_model",
    "k_proj.weight": "model.num_kv_heads, model.head_dim, model.d_model",
    "v_proj.weight": "model.num_kv_heads, model.head_dim, model.d_model",
    "mlp.gate_proj.weight": "model.d_ff, model.d_model",
    "mlp.up_proj.weight": "model.d_ff, model.d_model",
    "mlp.down_proj.weight": "model.d_ff, model.d_model",
}


def _check_shape(source, name, stacked, transposed, shape, folder) -> None:
    """One line naming the tensor (or the layer count) the model config does not match, and
    the `model.*` keys that size it."""
    first = name.format(i=0)
    if first not in source:
        raise ConfigError(f"hf:{folder} has no tensor {first}; is it a Llama checkpoint?")
    if stacked and (layers := _layers_of(source, name)) != shape[0]:
        if layers < shape[0] and name.format(i=shape[0] - 1) in source:  # a gap
            raise ConfigError(
                f"hf:{folder} has no tensor {name.format(i=layers)}; download the weights again"
            )
        raise ConfigError(
            f"hf:{folder} holds {layers} layer{'s' * (layers > 1)} ({name.format(i='N')}), the "
            f"model expects {shape[0]}; {_mismatch_fix('model.num_layers')}"
        )
    theirs = source.shape(first)
    ours = tuple(shape[1:] if stacked else shape)
    if (theirs[::-1] if transposed else theirs) != ours:
        keys = next((keys for end, keys in _SIZED_BY.items() if first.endswith(end)), "model.*")
        raise ConfigError(
            f"hf:{folder} tensor {first} has shape {list(theirs)}, the model expects "
            f"{list(ours[::-1] if transposed else ours)}; {_mismatch_fix(keys)}"
        )


def _mismatch_fix(keys: str) -> str:
    """The fix for weights of another size: model.* set in the --config file or overrides wins
    over config.json, and a config.json edited apart from its weights misleads it."""
    return (
        f"leave {keys} unset (in the --config file too) to follow config.json, or restore "
        "the config.json these weights came with"
    )


def hf_tensors(params: Any) -> Iterator[tuple[str, np.ndarray]]:
    """`(Hugging Face name, host array)` for every parameter, layer by layer."""
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name, stacked, transposed = NAMES[_path_of(keypath)]
        host = np.asarray(jax.device_get(leaf))
        blocks = enumerate(host) if stacked else [(0, host)]
        for i, block in blocks:
            yield name.format(i=i), np.ascontiguousarray(block.T if transposed else block)


def save_hf_weights(params: Any, out: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Safetensors files in `out` (sharded with an index above `max_shard_bytes`, as
    `save_pretrained` does); returns the file names."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in sorted(hf_tensors(params)):
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    mode = _new_file_mode(out)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(out / "model.safetensors", mode)
        return ["model.safetensors"]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        save_file(shard, str(out / file), metadata={"format": "pt"})
        os.chmod(out / file, mode)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(a.nbytes for shard in shards for a in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    return files


def _new_file_mode(folder: Path) -> int:
    """The mode a file created in `folder` gets (the umask, a default ACL): safetensors writes
    its files owner-only, which left the weights of an export to a shared folder unreadable to
    the others who read its config.json and tokenizer."""
    probe = folder / f".mode-probe-{os.getpid()}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        probe.unlink()
