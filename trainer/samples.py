"""`eval.sample_prompts`: at every eval, greedy continuations of a few prompts by the model being
trained (the KV-cache decoder of `trainer/generate.py`), on the console, in
`<workdir>/samples.jsonl` and in TensorBoard's Text tab: a look at what the loss means."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from trainer.config import Config
from trainer.generate import Generator, run_tokenizer
from trainer.observe.metrics import MetricsWriter
from trainer.parallel.offload import to_device_memory
from trainer.parallel.state import TrainState

SAMPLES_FILE = "samples.jsonl"


class Sampler:
    """Continues `eval.sample_prompts` from a train state; every process runs it (the decode is
    one SPMD program over the sharded parameters), the first one writes."""

    def __init__(self, config: Config, merge: Any, mesh: jax.sharding.Mesh, writer: MetricsWriter):
        self.prompts = list(config.eval.sample_prompts)
        self.tokens = config.eval.sample_tokens
        self.merge, self.mesh, self.writer = merge, mesh, writer
        self.path = Path(config.run.workdir) / SAMPLES_FILE
        self.tokenizer = run_tokenizer(config)

    def __call__(self, step: int, state: TrainState) -> None:
        # offloaded parameters (model.offload_params) decode from a copy in device memory
        model = self.merge(to_device_memory(state.params), state.model_state)
        generator = Generator(
            model, self.mesh, self.tokenizer, getattr(self.tokenizer, "eos_id", None)
        )
        for index, prompt in enumerate(self.prompts):
            text = generator.complete(prompt, max_new_tokens=self.tokens, temperature=0.0)
            self.writer.message(f"sample {step}: {prompt!r} -> {text!r}")
            self.writer.text(step, f"sample_{index}", f"**{prompt}**{text}")
            if jax.process_index() == 0:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"step": step, "prompt": prompt, "text": text}) + "\n")


def make_sampler(
    config: Config, build: Any, mesh: jax.sharding.Mesh, writer: MetricsWriter, builtin: bool
) -> Sampler | None:
    """A sampler when prompts are set, the model is the built-in transformer and the dataset's
    tokenizer can be read; otherwise None (with a line saying why, if prompts were set)."""
    if not config.eval.sample_prompts:
        return None
    if not builtin:
        writer.message("eval.sample_prompts needs the built-in transformer; not sampling")
        return None
    if run_tokenizer(config) is None:
        writer.message("eval.sample_prompts: the dataset has no readable tokenizer; not sampling")
        return None
    from trainer.parallel import sharding
    from trainer.parallel.state import abstract_model

    with jax.set_mesh(mesh):
        skeleton, _, _ = abstract_model(build, mesh, sharding.resolve_rules(config.mesh.rules))
    return Sampler(config, skeleton.merge, mesh, writer)
