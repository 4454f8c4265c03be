"""Sample text from a checkpoint: `python -m trainer.generate --workdir W [--step N] --prompt
"..." [--max-new-tokens 200 --temperature 0.8 --top-k 50 --top-p 0.95 --seed 0]`, or `--workdir
hf:PATH` for a Hugging Face folder. One jitted function runs prefill and the whole decode loop
over a key/value cache; the model is sharded over the available devices (`mesh.fsdp`), so a
model larger than one device's memory still generates. `--temperature 0` is greedy."""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from input_pipeline.corpora import BUILTIN_CORPORA, builtin_dataset_dir
from input_pipeline.dataset_info import INFO_FILE, load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.records import available_memory
from input_pipeline.tokenizers import (
    HF_TOKENIZER_FILE,
    SENTENCEPIECE_FILE,
    Tokenizer,
    get_tokenizer,
    tokenizer_from_file,
)
from trainer.checkpoint import Checkpointer
from trainer.config import Config, DataConfig, load_config
from trainer.errors import USER_ERRORS, ConfigError, TrainingError
from trainer.hf import hf_folder
from trainer.hf.config import CONFIG_FILE, read_hf_config
from trainer.models import abstract_params, model_spec
from trainer.models.spec import Decoder
from trainer.parallel import sharding


@dataclass
class Generator:
    """A model with a decoder, sharded on `mesh`, and the tokenizer its data used (if known)."""

    model: nnx.Module | None  # None: a template whose model each use fills in (`replace`)
    decoder: Decoder
    mesh: jax.sharding.Mesh
    tokenizer: Any = None
    eos_id: int | Sequence[int] | None = None  # several: generation stops at any of them

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = 50,
        top_p: float = 0.95,
        seed: int = 0,
    ) -> np.ndarray:
        """`max_new_tokens` ids after `prompt_ids` (cut after the first end-of-text id, if
        known)."""
        if not len(prompt_ids):
            raise ConfigError("the prompt encodes to no tokens; give a --prompt with some text")
        check_settings(max_new_tokens, temperature, top_k, top_p, seed)
        check_cache_fits(self, len(prompt_ids) + max_new_tokens)
        graphdef, state = nnx.split(self.model)
        ends = () if self.eos_id is None else tuple(np.atleast_1d(self.eos_id).tolist())
        settings = (max_new_tokens, float(temperature), top_k, float(top_p), ends)
        run = _compiled(graphdef, self.decoder, self.mesh, *settings)
        prompt_1xP = jnp.asarray([list(prompt_ids)], jnp.int32)
        with jax.set_mesh(self.mesh):
            ids = np.asarray(run(state, prompt_1xP, jax.random.key(seed)))[0]
        if ends and (is_end := np.isin(ids, ends)).any():
            ids = ids[: int(np.argmax(is_end)) + 1]
        return ids

    def complete(self, prompt: str, **settings: Any) -> str:
        """The text a prompt continues with (needs the run's tokenizer)."""
        ids = self.generate(self.tokenizer.encode(prompt).tolist(), **settings)
        return self.tokenizer.decode(ids)


def check_cache_fits(generator: Generator, length: int) -> None:
    """One line for a key/value cache of `length` positions larger than the devices' memory,
    before XLA tries to allocate it (XLA:CPU may abort the process on that failure)."""
    model = generator.model
    cache = jax.eval_shape(lambda: generator.decoder.empty_cache(model, 1, length))
    need = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))
    device = generator.mesh.local_devices[0]  # samples in training: the run's mesh, all hosts
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit is None:  # CPU devices: each holds a copy, all in the host's memory
        limit, need = available_memory(), need * generator.mesh.size
    if need > limit:  # the cache alone: decoding needs more, which XLA may still refuse
        raise TrainingError(
            f"a key/value cache of {length} positions needs {need / 2**30:.1f} GiB, more than "
            f"the devices' {limit / 2**30:.1f} GiB; lower --max-new-tokens (eval.sample_tokens "
            "for samples in training) or shorten the prompt"
        )


_MAX_POSITION = 2**31 - 1  # positions are int32 on the device


def check_settings(max_new_tokens: int, temperature: float, top_k, top_p: float, seed: int) -> None:
    """One line naming a sampling setting that would fail to compile or silently sample wrong
    (a negative temperature inverts the distribution; top-p 0 keeps no token)."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} is not a token count; pass 1 or more")
    if max_new_tokens > _MAX_POSITION:
        raise ConfigError(
            f"--max-new-tokens {max_new_tokens} is past the last position the decoder counts "
            f"to (int32); pass at most {_MAX_POSITION}"
        )
    if not 0 <= temperature < math.inf:
        raise ConfigError(
            f"--temperature {temperature} is not a temperature; pass 0 (greedy) or a positive "
            "number such as 0.8"
        )
    if top_k is not None and top_k < 0:
        raise ConfigError(f"--top-k {top_k} is negative; pass 0 (no cut) or a count such as 50")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p {top_p} is outside (0, 1]; pass 1 (no cut) or e.g. 0.95")
    if not -(2**63) <= seed < 2**63:
        raise ConfigError(f"--seed {seed} does not fit in 64 bits; pass a smaller seed such as 0")


def sample(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_k, top_p: float):
    """Next tokens: argmax at temperature 0, else from the top-k / top-p (nucleus) renormalized
    distribution at that temperature."""
    if temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = _tempered(logits_BxV, temperature)
    if top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, min(top_k, logits_BxV.shape[-1]))[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    if top_p < 1.0:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # mass of more likely tokens
        kept_BxV = jnp.where(before_BxV < top_p, sorted_BxV, jnp.inf)
        cutoff_Bx1 = jnp.min(kept_BxV, axis=-1, keepdims=True)  # the top token is always kept
        logits_BxV = jnp.where(logits_BxV < cutoff_Bx1, -jnp.inf, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def _tempered(logits_BxV: jax.Array, temperature: float) -> jax.Array:
    """`logits / temperature` with the top logit at 0, so a tiny temperature sends the others to
    -inf (near-greedy) instead of overflowing float32 to inf - inf = NaN."""
    shifted_BxV = logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True)
    return jnp.where(shifted_BxV == 0, 0.0, shifted_BxV / temperature)


@functools.lru_cache(maxsize=16)
def _compiled(
    graphdef,
    decoder: Decoder,
    mesh,
    max_new_tokens: int,
    temperature: float,
    top_k,
    top_p: float,
    ends: tuple[int, ...],
):
    """Prefill then a `while_loop` of one-token decode steps, jitted once per settings; the
    tokens come back replicated, readable on every host. The loop stops once every row has
    sampled one of the end-of-text ids `ends` (the positions after it stay 0): a short answer
    does not pay for the whole `max_new_tokens`."""

    def ended(token_B: jax.Array) -> jax.Array:
        return jnp.isin(token_B, jnp.asarray(ends, jnp.int32)) if ends else token_B < 0

    def run(state, prompt_BxP, key):
        model = nnx.merge(graphdef, state)
        B, P = prompt_BxP.shape
        cache = decoder.empty_cache(model, B, P + max_new_tokens)
        logits_BxPxV, cache = decoder.decode(model, prompt_BxP, jnp.int32(0), cache)
        key, now = jax.random.split(key)
        first_B = sample(logits_BxPxV[:, -1], now, temperature, top_k, top_p)
        out_BxN = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(first_B)

        def going(carry) -> jax.Array:
            i, _, _, _, done_B = carry
            return (i < max_new_tokens) & ~done_B.all()

        def step(carry):
            i, out_BxN, cache, key, done_B = carry
            last_Bx1 = jax.lax.dynamic_slice_in_dim(out_BxN, i - 1, 1, axis=1)
            logits_Bx1xV, cache = decoder.decode(model, last_Bx1, P + i - 1, cache)
            key, now = jax.random.split(key)
            token_B = sample(logits_Bx1xV[:, -1], now, temperature, top_k, top_p)
            return i + 1, out_BxN.at[:, i].set(token_B), cache, key, done_B | ended(token_B)

        carry = (jnp.int32(1), out_BxN, cache, key, ended(first_B))
        return jax.lax.while_loop(going, step, carry)[1]

    return jax.jit(run, out_shardings=NamedSharding(mesh, PartitionSpec()))


# ----------------------------------------------------------------------------- loading


def load_generator(
    source: str,
    step: int | None = None,
    compute: str | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Generator:
    """A run's workdir (its saved config and checkpoint `step`, default the latest) or
    `hf:PATH`, loaded onto `devices` (default all) with the parameters sharded over them."""
    folder = hf_folder(source)
    if folder is not None:
        return _load_hf(folder, compute, devices)
    return _load_workdir(source, step, compute, devices)


def _load_model(
    config: Config, compute: str | None, devices, read_params: Callable[[Any], Any]
) -> Generator:
    """`config`'s model with the parameters `read_params(restore target)` gives, sharded over
    every device on the fsdp axis (weights split along `embed`), as many as divide it."""
    decoder = model_spec(config.model.kind).decoder
    if decoder is None:
        raise ConfigError(
            f"trainer.generate samples the built-in transformer, not model.kind="
            f"{config.model.kind} (it has no key/value-cache decoder); export its parameters "
            "with python -m trainer.export and sample them with your model's own code"
        )
    devices = list(devices or jax.devices())
    count = math.gcd(len(devices), config.model.d_model)
    mesh_axes = {"mesh.stage": 1, "mesh.data": 1, "mesh.fsdp": count, "mesh.tensor": 1}
    compute_dtype = {"precision.compute": compute} if compute else {}
    config = config.derive({**mesh_axes, "mesh.rules": {}, "model.dropout": 0.0, **compute_dtype})
    mesh = sharding.make_mesh(config.mesh, devices[:count])
    skeleton, target = abstract_params(config, mesh)
    with jax.set_mesh(mesh):
        model = skeleton.merge(read_params(target), {})
    return Generator(model, decoder, mesh)


def _load_hf(folder: str, compute: str | None, devices) -> Generator:
    if not (Path(folder) / CONFIG_FILE).is_file():  # read_hf_config would name init_from
        lacks = f"no {CONFIG_FILE} there" if Path(folder).is_dir() else "no such folder"
        raise ConfigError(
            f"--workdir hf:{folder}: {lacks}; point it at a local Hugging Face model folder "
            "(config.json + *.safetensors), or at a run's workdir without hf:"
        )
    config = load_config(None, [f"checkpoint.init_from=hf:{folder}"])  # model.* of config.json
    read = functools.partial(model_spec(config.model.kind).hf.load_params, folder)
    generator = _load_model(config, compute, devices, read)
    tokenizer = hf_folder_tokenizer(Path(folder))
    eos = read_hf_config(folder).get("eos_token_id")  # a list in chat models: stop at any
    eos = tuple(eos) if isinstance(eos, list) else eos
    return replace(generator, tokenizer=tokenizer, eos_id=_eos(tokenizer) if eos is None else eos)


def hf_folder_tokenizer(folder: Path) -> Tokenizer | None:
    """The tokenizer a Hugging Face folder carries: its `tokenizer.json`, else the SentencePiece
    `tokenizer.model` that `trainer.export --format hf` writes for a SentencePiece dataset."""
    for name in (HF_TOKENIZER_FILE, SENTENCEPIECE_FILE):
        if (folder / name).is_file():
            return tokenizer_from_file(folder / name)
    return None


def _load_workdir(workdir: str, step: int | None, compute: str | None, devices) -> Generator:
    """Checkpoint `step` of a run, or its newest that restores (a damaged one is named in one
    line and skipped, as export and `checkpoint.init_from` do)."""

    def restore(checkpointer: Checkpointer, step: int) -> tuple[Config, Generator]:
        config = checkpointer.run_config(step)
        read = functools.partial(checkpointer.restore_params, step)
        return config, _load_model(config, compute, devices, read)

    _, (config, generator) = Checkpointer.restore_past_run(
        workdir, step, restore, advice="repair it, or generate from another --step"
    )
    tokenizer = run_tokenizer(config.data)
    return replace(generator, tokenizer=tokenizer, eos_id=_eos(tokenizer))


def run_tokenizer(data: DataConfig) -> Tokenizer | None:
    """The tokenizer recorded with the run's dataset, if that folder is still there."""
    path = data.mixture[0].path if data.mixture else data.path
    folder = Path(path)
    if path in BUILTIN_CORPORA:
        folder = builtin_dataset_dir(path, data.cache_dir)
    if not (folder / INFO_FILE).is_file():
        return None
    info = load_dataset_info(folder)
    return get_tokenizer(info.tokenizer, folder)


def _eos(tokenizer) -> int | None:
    return getattr(tokenizer, "eos_id", None)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workdir", required=True, help="a run's workdir, or hf:PATH")
    parser.add_argument("--step", type=int, default=None, help="default: the latest")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=50, help="0: no top-k cut")
    parser.add_argument("--top-p", type=float, default=0.95, help="1: no nucleus cut")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute", choices=["bfloat16", "float16", "float32"], default=None)
    args = parser.parse_args(argv)
    try:
        check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
        if not args.prompt:
            raise ConfigError("--prompt is empty; give some text for the model to continue")
        generator = load_generator(args.workdir, args.step, args.compute)
        if generator.tokenizer is None:
            raise DataError(
                f"no tokenizer for {args.workdir}: a Hugging Face folder needs tokenizer.json or "
                "tokenizer.model, a run its dataset folder (data.path)"
            )
        text = _complete(generator, args)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(args.prompt + text)
    return 0


def _complete(generator: Generator, args: argparse.Namespace) -> str:
    """The CLI's sample; a key/value cache (prompt + new tokens) too large for the devices is
    one line naming the flags that size it."""
    try:
        return generator.complete(
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            top_p=args.top_p,
            seed=args.seed,
        )
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        raise TrainingError(
            f"generating {args.max_new_tokens} tokens after a {len(args.prompt)}-character "
            "prompt ran out of device memory (the key/value cache holds every position); "
            "lower --max-new-tokens or shorten --prompt"
        ) from None


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
