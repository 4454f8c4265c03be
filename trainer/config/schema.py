"""The typed config schema: defaults live here; YAML files and `section.key=value` overrides
(`trainer.config.reading`) only change them. Every user mistake becomes a one-line `ConfigError`
that names the key and the fix (`trainer.config.validation`)."""

from __future__ import annotations

import math
import typing
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticKnownError

from trainer.config.validation import as_typed, set_dotted, validated
from trainer.hf.config import ROPE_SCALING_KEYS, split_rope_scaling

# Exit statuses the trainer and its launchers already give a meaning: a stop must not read as one.
TAKEN_EXIT_STATUSES = {
    1: "a crash",
    2: "a user error",
    3: "a stuck process (trainer/observe/watchdog.py)",
    130: "an interrupt without saving",
    137: "a process killed by SIGKILL",
    143: "a process killed by SIGTERM",
}


class _Section(BaseModel):
    """Strict, read-only section: unknown keys are errors; variants come from `Config.derive`.
    Numbers must be finite (`.inf` and `.nan` train nothing) and text must not be empty (an empty
    `run.workdir` is the current folder)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        populate_by_name=True,
        allow_inf_nan=False,
        str_min_length=1,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic's lax mode reads true as 1: `run.steps=true` would train one step. Strict
        number types would also refuse `optim.lr=3e-4`, which YAML reads as text."""
        if isinstance(value, bool) and info.field_name is not None:
            number = _number_type(cls.model_fields[info.field_name].annotation)
            if number is not None:
                raise PydanticKnownError("int_type" if number is int else "float_type")
        return value


def _number_type(annotation: Any) -> type | None:
    """`int` or `float` where `annotation` (`int`, `float | None`, `int | Literal[...]`) takes a
    number; None for any other type (`bool` included)."""
    for kind in (annotation, *typing.get_args(annotation)):
        if kind in (int, float):
            return kind
    return None


class RunConfig(_Section):
    name: str = "run"  # the label of the startup line and `trainer.report`; "run" = the folder's
    workdir: str = "workdirs/run"
    seed: int = Field(0, ge=0, lt=2**63)  # Grain refuses a negative seed; jax.random.key, 2**63
    steps: int = Field(1000, ge=1)
    # Seconds a step (or its data wait, eval, save) may take before the process dumps its stacks
    # and exits 3 (trainer/observe/watchdog.py); the first step (compiling) gets at least 15
    # minutes. None: 10x the median of the first steps, at least 300 s (15 minutes for evals
    # and saves). .inf: never (the one float key where infinity means something: no watchdog)
    step_timeout_s: float | None = Field(None, gt=0, allow_inf_nan=True)
    # The exit status of a run that stops before run.steps (a SIGTERM or Ctrl-C it saved at, or
    # one during start-up). 0 for launchers that resume on their own (launch/slurm.sbatch,
    # launch/local.sh); non-zero where only a failed process is started again: a Kubernetes Job
    # counts a pod that exits 0 as done (launch/k8s/trainer.yaml sets 75)
    stop_exit_status: int = Field(0, ge=0, le=255)

    @field_validator("stop_exit_status")
    @classmethod
    def _distinct_stop_status(cls, status: int) -> int:
        """A stop must not read as a crash, a user error, a stuck task or a lost interrupt."""
        if status in TAKEN_EXIT_STATUSES:
            raise ValueError(
                f"run.stop_exit_status={status} already means {TAKEN_EXIT_STATUSES[status]}; give "
                "another (75, EX_TEMPFAIL, is the usual one), or 0"
            )
        return status

    @field_validator("workdir")
    @classmethod
    def _local_workdir(cls, workdir: str) -> str:
        """A URL would become a local folder named `gs:`, then fail at the first save."""
        if "://" in workdir:
            raise ValueError(
                f"run.workdir={workdir} is a URL, and the trainer writes local paths; mount the "
                "bucket (e.g. gcsfuse) at the same path on every host and give that path"
            )
        return workdir


class MixtureSource(_Section):
    path: str  # a prepared dataset folder (or a built-in corpus name)
    weight: float = Field(gt=0)  # share of the rows; weights need not sum to 1
    name: str | None = None  # in metrics (`tokens_<name>`, `eval_loss_<name>`); default: folder


class DataConfig(_Section):
    path: str = "python-stdlib"
    # Several prepared datasets blended by weight (replaces `path`); they share one tokenizer.
    mixture: list[MixtureSource] | None = None
    cache_dir: str | None = None  # where built-in corpora are prepared
    # memory: every shard read into RAM once (after its checksum check) and served from there
    cache: Literal["none", "memory"] = "none"
    seq_len: int = Field(256, ge=2)
    global_batch_size: int = Field(32, ge=1)
    packing: Literal["concat", "first_fit"] = "concat"
    # At most this many documents (segments) in one packed row, as the cuDNN packed-document
    # attention kernel takes a static count per row: both packers end a row that reaches it with
    # padding (excluded from `tokens`), never merging or dropping a document. auto: grows with
    # seq_len (`resolved_max_docs_per_row`; padding measured in BENCHMARKS.md)
    max_docs_per_row: int | Literal["auto"] = "auto"
    # concat packing: none cuts rows where the record stream puts them; random_per_epoch drops
    # a seeded 0..seq_len-1 leading tokens of each epoch's first record (ArrayRecord data), so
    # the rows of every epoch are new windows (deterministic from run.seed, resumable)
    concat_offset: Literal["none", "random_per_epoch"] = "none"
    shuffle: bool = True
    read_threads: int = Field(4, ge=1)
    workers: int = Field(0, ge=0)
    prefetch: int = Field(4, ge=1)
    reader: Literal["auto", "grain", "tfdata"] = "auto"  # TFRecord: auto = grain, or tf.data
    skip_corrupt: bool = False
    verify_checksums: bool = True  # sha256 at start of each shard this host has not checked
    # Independent input streams per global batch (fixed = same batches on any process count);
    # unset: the process count of the run's first start, kept on resume.
    streams: int | None = Field(None, ge=1)

    @field_validator("mixture")
    @classmethod
    def _mixture_has_sources(cls, value: Any) -> Any:
        if value is not None and not value:  # an empty list would silently train on data.path
            raise ValueError(
                "data.mixture is an empty list; list at least one {path, weight} source, or "
                "remove data.mixture to train on data.path"
            )
        return value

    @field_validator("max_docs_per_row", mode="before")
    @classmethod
    def _docs_bound(cls, value: Any) -> Any:
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError(
            f"data.max_docs_per_row={value!r} is not a document count; use an integer >= 1, or auto"
        )

    @model_validator(mode="after")
    def _offset_needs_concat(self) -> DataConfig:
        if self.concat_offset != "none" and self.packing != "concat":
            raise ValueError(
                f"data.concat_offset={self.concat_offset} moves concat packing's rows but "
                f"data.packing={self.packing}; use data.packing=concat or data.concat_offset=none"
            )
        return self

    @property
    def resolved_max_docs_per_row(self) -> int:
        """The bound on documents per row that the packers apply and the attention kernel is
        built for. auto: room for documents averaging 64 tokens, plus 4 for their spread, which
        adds little padding (BENCHMARKS.md, "Documents per packed row"), while each unit costs
        the cuDNN kernel workspace."""
        if self.max_docs_per_row == "auto":
            return -(-self.seq_len // 64) + 4
        return self.max_docs_per_row


class ModelConfig(_Section):
    kind: str = "transformer"
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int | None = Field(None, ge=1)
    d_model: int = Field(256, ge=1)
    d_ff: int = Field(1024, ge=1)
    vocab_size: int | None = Field(None, ge=2)
    max_seq_len: int | None = Field(None, ge=2)
    rope_theta: float = Field(10000.0, gt=0)
    # Llama 3 / Mistral checkpoints need these to match exactly (trainer/hf/config.py reads them
    # from a Hugging Face config.json)
    norm_eps: float = Field(1e-6, gt=0)
    head_dim: int | None = Field(None, ge=2)  # None: d_model // num_heads
    # None, or {type: linear, factor} or {type: llama3, factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings}: rotary frequencies rescaled
    rope_scaling: dict[str, Any] | None = None
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    tie_embeddings: bool = False
    # full: recompute each layer in the backward pass; save_dots: keep the matmul outputs;
    # offload_dots: keep them in pinned host memory instead of device memory
    remat: Literal["none", "full", "save_dots", "offload_dots"] = "none"
    # ZeRO-Offload: the float32 master parameters live in pinned host memory between steps; the
    # step moves them in, and the updated ones back out (trainer/parallel/offload.py)
    offload_params: bool = False
    # false: a Python loop over the layers (compile time grows with depth; for shallow models
    # on CPU, where the scan's stacked residual buffers and per-layer slicing cost time:
    # BENCHMARKS.md, nanoGPT recipe)
    scan_layers: bool = True
    # auto: the fastest kernel that runs correctly on this device, dtype and batch: cuDNN or
    # Pallas flash attention over packed documents on NVIDIA GPUs of compute capability 8.0+ with
    # bf16/fp16 compute, XLA with the document mask elsewhere and while dropout trains (table in
    # trainer/models/attention.py); cudnn: a cuDNN kernel or a config error
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads="
                f"{self.num_heads}; pick d_model as a multiple of num_heads, or set model.head_dim"
            )
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={kv}; "
                "use a divisor of num_heads"
            )
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} is odd; rotary needs an even size")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)
        return self


def _check_rope_scaling(scaling: dict[str, Any]) -> None:
    """Checked here, not when the model is built: a bad value would stop a run mid-compile."""
    kind, _ = split_rope_scaling(scaling, "model.rope_scaling")
    if kind is None:
        raise ValueError(
            f"model.rope_scaling has no type; add type: one of {sorted(ROPE_SCALING_KEYS)} "
            "(or leave model.rope_scaling unset)"
        )
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(
            f"model.rope_scaling type {kind!r} is not supported; use one of "
            f"{sorted(ROPE_SCALING_KEYS)} (or leave model.rope_scaling unset)"
        )
    missing = [key for key in ROPE_SCALING_KEYS[kind] if key not in scaling]
    if missing:
        raise ValueError(f"model.rope_scaling of type {kind} needs {', '.join(missing)}")
    for key in ROPE_SCALING_KEYS[kind]:
        value = scaling[key]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and 0 < value < math.inf):
            raise ValueError(
                f"model.rope_scaling.{key}={value!r} is not a positive finite number; set it as "
                "the checkpoint's config.json does (e.g. factor: 8.0)"
            )


class MeshConfig(_Section):
    # Pipeline stages: the layer stack is cut into `stage` contiguous pieces, one per group of
    # devices, and microbatches flow through them (trainer/parallel/pipeline.py, `pipeline.*`)
    stage: int = Field(1, ge=1)
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: dict[str, str | list[str] | None] = Field(default_factory=dict)

    @field_validator("rules", mode="before")
    @classmethod
    def _rule_targets(cls, value: Any) -> Any:
        """Checked here so the error names the rule, not pydantic's union member (`.str`)."""
        for name, target in value.items() if isinstance(value, dict) else ():
            axes = target if isinstance(target, list) else [target]
            if target is not None and not all(isinstance(axis, str) for axis in axes):
                raise ValueError(
                    f"mesh.rules.{name}={as_typed(target)} is not a mesh axis; use an axis "
                    "name, a list of them, or null (not sharded), e.g. mesh.rules={kv: tensor}"
                )
        return value

    @model_validator(mode="after")
    def _one_fill_axis(self) -> MeshConfig:
        sizes = {"mesh.data": self.data, "mesh.fsdp": self.fsdp, "mesh.tensor": self.tensor}
        bad = [k for k, v in sizes.items() if v == 0 or v < -1]
        if bad:
            raise ValueError(
                f"{bad[0]}={sizes[bad[0]]} is not a mesh size; use a positive size or -1"
            )
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ValueError("more than one mesh axis is -1; only one axis may fill the rest")
        return self


class PipelineConfig(_Section):
    """How batches flow through `mesh.stage` pipeline stages (GPipe schedule)."""

    # Microbatches each batch (each accumulation microbatch) is cut into; a multiple of
    # mesh.stage. The idle share of a step is (stage-1)/(microbatches+stage-1). None: 2 x stage
    microbatches: int | None = Field(None, ge=1)


class PrecisionConfig(_Section):
    # float16: for GPUs without fast bf16 (RTX 20xx, V100, T4), with dynamic loss scaling
    compute: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    params: Literal["float32", "bfloat16"] = "float32"
    # float16 only: start, double after `period` finite steps in a row, halve (and skip the
    # step) on a non-finite gradient, within [min, max]
    loss_scale_init: float = Field(2.0**15, gt=0)
    loss_scale_period: int = Field(2000, ge=1)
    loss_scale_min: float = Field(1.0, gt=0)
    loss_scale_max: float = Field(2.0**24, gt=0)

    @model_validator(mode="after")
    def _scale_bounds(self) -> PrecisionConfig:
        if not self.loss_scale_min <= self.loss_scale_init <= self.loss_scale_max:
            raise ValueError(
                f"precision.loss_scale_init={self.loss_scale_init} is outside [loss_scale_min="
                f"{self.loss_scale_min}, loss_scale_max={self.loss_scale_max}]; pick a start "
                "between the bounds"
            )
        return self


class OptimConfig(_Section):
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(3e-5, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(100, ge=0)
    decay_steps: int | None = Field(None, ge=1)
    weight_decay: float = Field(0.1, ge=0)
    clip_norm: float | None = Field(1.0, gt=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    accum_steps: int = Field(1, ge=1)
    skip_nonfinite: bool = False
    # ZeRO-Offload: the optimizer state (Adam moments) lives in pinned host memory between
    # steps; the step moves it in for the update and back out (trainer/parallel/offload.py)
    offload: bool = False


class CheckpointConfig(_Section):
    every: int = Field(500, ge=1)
    keep: int = Field(3, ge=1)
    keep_every: int | None = Field(None, ge=1)
    async_: bool = Field(True, alias="async")
    init_from: str | None = None


class LogConfig(_Section):
    every: int = Field(10, ge=1)
    tensorboard: bool = True
    progress: bool = True
    peak_tflops: float | None = Field(None, gt=0)
    # JAX profiler trace of steps start..end-1 (like range) into <workdir>/profile/
    profile_steps: tuple[int, int] | None = None

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _profile_window(cls, value: Any) -> Any:
        if value is None:
            return None
        pair = list(value) if isinstance(value, list | tuple) else None
        if not (pair and len(pair) == 2 and all(type(v) is int for v in pair)):
            raise ValueError(
                f"log.profile_steps={value!r} is not two step numbers; use [start, end], "
                "e.g. [10, 12] to trace steps 10 and 11"
            )
        if not 1 <= pair[0] < pair[1]:
            raise ValueError(
                f"log.profile_steps={pair} needs 1 <= start < end; e.g. [10, 12] traces "
                "steps 10 and 11"
            )
        return tuple(pair)


class EvalConfig(_Section):
    every: int = Field(200, ge=1)
    steps: int = Field(20, ge=1)
    # Prompts continued greedily at every eval (built-in transformer; printed, and written to
    # <workdir>/samples.jsonl and TensorBoard), `sample_tokens` tokens each
    sample_prompts: list[str] = Field(default_factory=list)
    sample_tokens: int = Field(32, ge=1)


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _cross_section(self) -> Config:
        if self.optim.min_lr > self.optim.lr:
            raise ValueError(
                f"optim.min_lr={self.optim.min_lr} is above optim.lr={self.optim.lr}; "
                "set min_lr <= lr"
            )
        max_len = self.model.max_seq_len
        if max_len is not None and self.data.seq_len > max_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} is longer than model.max_seq_len={max_len}; "
                "lower data.seq_len or raise model.max_seq_len"
            )
        self._check_pipeline()
        return self

    def _check_pipeline(self) -> None:
        stages = self.mesh.stage
        if stages == 1:
            return
        microbatches = self.pipeline_microbatches
        if microbatches < stages:
            raise ValueError(
                f"pipeline.microbatches={microbatches} is fewer than mesh.stage={stages}; "
                f"use at least {stages} (the idle share is (stages-1)/(microbatches+stages-1))"
            )
        if microbatches % stages:
            raise ValueError(
                f"pipeline.microbatches={microbatches} is not a multiple of mesh.stage={stages}; "
                f"use e.g. {stages * -(-microbatches // stages)} (outside the pipeline each "
                "stage holds its own share of every microbatch's rows)"
            )
        if self.model.num_layers % stages:  # a model without stages is refused when built
            raise ValueError(
                f"model.num_layers={self.model.num_layers} does not split into mesh.stage="
                f"{stages} equal stages; use a stage count that divides the layer count"
            )

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches per pipelined batch: `pipeline.microbatches`, default 2 x stages."""
        return self.pipeline.microbatches or 2 * self.mesh.stage

    def derive(self, changes: dict[str, Any]) -> Config:
        """A copy with dotted `changes` (`{"mesh.stage": 1}`), validated as overrides are."""
        tree = self.model_dump(by_alias=True)
        for key, value in changes.items():
            set_dotted(tree, key, value)
        return validated(Config, tree)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict with the YAML spelling of every key (e.g. `checkpoint.async`)."""
        return self.model_dump(by_alias=True, mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
