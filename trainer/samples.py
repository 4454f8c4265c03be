"""`eval.sample_prompts`: at every eval, greedy continuations of a few prompts by the model being
trained (the KV-cache decoder of `trainer/generate.py`), on the console, in
`<workdir>/samples.jsonl` and in TensorBoard's Text tab: a look at what the loss means."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax

from input_pipeline.tokenizers import Tokenizer
from trainer.config import Config
from trainer.generate import Generator
from trainer.models.spec import Decoder
from trainer.observe.metrics import MetricsWriter
from trainer.parallel.offload import to_device_memory
from trainer.parallel.state import ModelSkeleton, TrainState

SAMPLES_FILE = "samples.jsonl"


class Sampler:
    """Continues `eval.sample_prompts` from a train state; every process runs it (the decode is
    one SPMD program over the sharded parameters), the first one writes."""

    def __init__(self, config: Config, merge: Any, generator: Generator, writer: MetricsWriter):
        self.prompts = list(config.eval.sample_prompts)
        self.tokens = config.eval.sample_tokens
        self.merge, self.generator, self.writer = merge, generator, writer
        self.path = Path(config.run.workdir) / SAMPLES_FILE

    def __call__(self, step: int, state: TrainState) -> None:
        # offloaded parameters (model.offload_params) decode from a copy in device memory
        model = self.merge(to_device_memory(state.params), state.model_state)
        generator = replace(self.generator, model=model)
        for index, prompt in enumerate(self.prompts):
            text = generator.complete(prompt, max_new_tokens=self.tokens, temperature=0.0)
            self.writer.message(f"sample {step}: {prompt!r} -> {text!r}")
            self.writer.text(step, f"sample_{index}", f"**{prompt}**{text}")
            if jax.process_index() == 0:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"step": step, "prompt": prompt, "text": text}) + "\n")


def make_sampler(
    config: Config,
    decoder: Decoder | None,
    skeleton: ModelSkeleton,
    mesh: jax.sharding.Mesh,
    writer: MetricsWriter,
    load_tokenizer: Callable[[], Tokenizer] | None,
) -> Sampler | None:
    """A sampler when prompts are set, the model has a `decoder` and the data a tokenizer;
    otherwise None (with a line saying why, if prompts were set). `skeleton` is the trained
    model's, so the model is not traced a second time."""
    if not config.eval.sample_prompts:
        return None
    if decoder is None:
        writer.message("eval.sample_prompts needs the built-in transformer; not sampling")
        return None
    if load_tokenizer is None:
        writer.message("eval.sample_prompts: the data has no tokenizer; not sampling")
        return None
    tokenizer = load_tokenizer()
    generator = Generator(None, decoder, mesh, tokenizer, getattr(tokenizer, "eos_id", None))
    return Sampler(config, skeleton.merge, generator, writer)
