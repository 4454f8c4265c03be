"""The config schema: defaults, YAML, overrides, and one-line errors that name the fix."""

import subprocess
import sys

import pydantic
import pytest

from trainer.config import Config, config_from_dict, load_config
from trainer.data import check_batch_layout
from trainer.errors import ConfigError


def test_defaults_validate():
    config = load_config()
    assert isinstance(config, Config)
    assert config.optim.lr > 0 and config.mesh.data == -1


def test_override_types_are_converted():
    config = load_config(None, ["optim.lr=1e-3", "checkpoint.async=false", "run.steps=7"])
    assert config.optim.lr == pytest.approx(1e-3)
    assert config.checkpoint.async_ is False
    assert config.run.steps == 7


def test_yaml_round_trip(tmp_path, repo_root):
    config = load_config(repo_root / "configs/demo.yaml", ["model.d_model=128"])
    saved = tmp_path / "config.yaml"
    saved.write_text(config.to_yaml())
    assert load_config(saved) == config


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["optim.lrr=1"], "unknown key optim.lrr; did you mean optim.lr?"),
        (["optim.lr=abc"], "optim.lr: Input should be a valid number"),
        (["optim.lr=-1"], "optim.lr: Input should be greater than 0"),
        (["data.packing=zip"], "data.packing: Input should be 'concat' or 'first_fit'"),
        (["modle.d_model=3"], "unknown key modle; did you mean model?"),
        (["model.d_model=100", "model.num_heads=3"], "model.d_model=100 is not divisible"),
        (["model.num_heads=4", "model.num_kv_heads=3"], "not a multiple of model.num_kv_heads"),
        (["mesh.data=-1", "mesh.fsdp=-1"], "only one axis may fill the rest"),
        (["optim.lr"], "is not section.key=value"),
        (["run.steps.x=1"], "run.steps"),
    ],
)
def test_user_errors_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ((32, 3, 1, 1), "=32 is not divisible by optim.accum_steps=3; use a multiple of 3 ("),
        ((32, 2, 3, 1), "=32 / optim.accum_steps=2 = 16 rows do not split over mesh data*fsdp=3"),
        ((30, 1, 2, 4), "by 4 data streams (data.streams, or the process count); use a multiple"),
        ((36, 2, 2, 8), "e.g. data.global_batch_size=40"),
    ],
)
def test_batch_layout_errors_name_the_keys_and_a_batch_that_fits(layout, expected):
    check_batch_layout(32, 4, 8, 2)  # 4 microbatches of 8 rows over 8 devices, 2 streams of 16
    with pytest.raises(ConfigError) as info:
        check_batch_layout(*layout)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_saved_config_revalidates():
    tree = load_config(None, ["optim.lr=0.01"]).to_dict()
    assert config_from_dict(tree).optim.lr == 0.01


def test_a_config_is_read_only_and_variants_are_derived():
    config = load_config(None, ["mesh.fsdp=2"])
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.mesh.fsdp = 4
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.mesh = config.mesh
    variant = config.derive({"mesh.stage": 1, "mesh.fsdp": 4, "model.args.extra": 2})
    assert (variant.mesh.fsdp, variant.model.args, config.mesh.fsdp) == (4, {"extra": 2}, 2)
    with pytest.raises(ConfigError, match=r"^unknown key mesh\.fsdpp; did you mean mesh\.fsdp\?$"):
        config.derive({"mesh.fsdpp": 4})
    with pytest.raises(ConfigError, match="mesh.fsdp=0 is not a mesh size"):
        config.derive({"mesh.fsdp": 0})


def cli(repo_root, *args):
    """`python -m trainer.main --config configs/demo.yaml ARGS`, as a user types it."""
    command = [sys.executable, "-m", "trainer.main", "--config", "configs/demo.yaml", *args]
    return subprocess.run(command, cwd=repo_root, capture_output=True, text=True, timeout=120)


def test_cli_exits_2_without_traceback(repo_root):
    proc = cli(repo_root, "optim.lrr=1")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "unknown key optim.lrr; did you mean optim.lr?" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_print_config(repo_root):
    proc = cli(repo_root, "--print-config", "data.seq_len=128")
    assert proc.returncode == 0, proc.stderr
    assert "seq_len: 128" in proc.stdout


def test_cli_mesh_that_does_not_match_devices_exits_2(repo_root, tmp_path):
    proc = cli(repo_root, "mesh.data=3", f"run.workdir={tmp_path}")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "mesh mesh.data=3, mesh.fsdp=1, mesh.tensor=1 needs 3 devices but 8 are present" in (
        proc.stderr
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["data.mixture=[{path: a, weight: 1, wieght: 2}]"],
            "unknown key data.mixture[0].wieght; did you mean data.mixture[0].weight?",
        ),
        (["data.mixture=[{path: a}]"], "data.mixture[0].weight is required; add it"),
        (["data.mixture=[]"], "data.mixture is an empty list; list at least one"),
        (["optim=3"], "optim=3 is not a mapping of keys; write optim as {key: value, ...}"),
        (["run.name=[oops"], "override run.name=[oops is not a valid YAML value; write lists"),
        (["checkpoint.async=maybe"], "(got 'maybe'); use true or false"),
        (["model.rope_scaling={type: linear, factor: abc}"], "rope_scaling.factor='abc' is not"),
        (["model.rope_scaling={factor: 2}"], "model.rope_scaling has no type; add type: one of"),
        (
            ["model.rope_scaling={type: linear, rope_type: llama3, factor: 2}"],
            "model.rope_scaling sets rope_type='llama3' and type='linear'; delete the wrong one",
        ),
    ],
)
def test_malformed_values_name_the_key_and_the_fix(overrides, expected):
    """Wrong shapes inside sections and lists: the key as the user wrote it, never a pydantic
    class name or an empty list of valid keys, and never a traceback at train time."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert expected in message and "\n" not in message
    assert "Config" not in message and "valid keys: ;" not in message


def test_rope_scaling_of_two_different_kinds_exits_2_naming_both_keys(repo_root):
    """`{type: llama3, rope_type: linear, ...}` was checked as llama3 and trained as linear."""
    llama3 = (
        "factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 16"
    )
    proc = cli(repo_root, f"model.rope_scaling={{type: llama3, rope_type: linear, {llama3}}}")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "model.rope_scaling sets rope_type='linear' and type='llama3'; delete" in proc.stderr


@pytest.mark.parametrize(
    "kind", ["type: linear", "rope_type: linear", "type: linear, rope_type: linear"]
)
def test_rope_scaling_kind_in_either_spelling_or_both_alike_loads(kind):
    scaling = load_config(None, [f"model.rope_scaling={{{kind}, factor: 2.0}}"]).model.rope_scaling
    assert scaling["factor"] == 2.0


def test_text_fields_keep_the_text_typed():
    """`run.name=0123` names the run "0123" (YAML would read the octal 83); null stays null."""
    config = load_config(
        None, ["run.name=0123", "data.path=2024", "model.kind=yes", "checkpoint.init_from=null"]
    )
    assert (config.run.name, config.data.path, config.model.kind) == ("0123", "2024", "yes")
    assert config.checkpoint.init_from is None
    assert load_config(None, ["optim.lr=1e-2"]).optim.lr == pytest.approx(1e-2)


def test_config_file_that_is_a_folder_or_not_text(tmp_path):
    with pytest.raises(ConfigError, match=r"is a folder; pass --config configs/<name>\.yaml$"):
        load_config(tmp_path)
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x89PNG")
    with pytest.raises(ConfigError, match="is not text .not UTF-8.; pass --config a YAML file"):
        load_config(binary)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["run.steps=true"], "run.steps: Input should be a valid integer (got true); use a whole"),
        (["mesh.fsdp=yes"], "mesh.fsdp: Input should be a valid integer (got true)"),
        (["optim.lr=true"], "optim.lr: Input should be a valid number (got true); use a number"),
        (["optim.weight_decay=false"], "optim.weight_decay: Input should be a valid number"),
        (["data.mixture=[{path: a, weight: on}]"], "data.mixture[0].weight: Input should be a"),
    ],
)
def test_a_bool_is_not_a_number(overrides, expected):
    """pydantic's lax mode read true as 1: `run.steps=true` trained one step and exited 0."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_numbers_a_user_writes_still_load():
    """YAML reads 3e-4 as text and 0 as an int: both still fill float keys; 2.0 fills an int."""
    config = load_config(
        None, ["optim.lr=3e-4", "optim.weight_decay=0", "run.steps=2.0", "model.dropout=0"]
    )
    assert (config.optim.lr, config.optim.weight_decay) == (pytest.approx(3e-4), 0.0)
    assert (config.run.steps, config.model.dropout) == (2, 0.0)
    assert type(config.run.steps) is int and type(config.optim.weight_decay) is float


FINITE = "Input should be a finite number"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.eps=.inf", f"optim.eps: {FINITE} (got inf); use a finite number"),
        ("optim.eps=nan", f"optim.eps: {FINITE} (got 'nan')"),
        ("optim.lr=.inf", f"optim.lr: {FINITE}"),
        ("optim.clip_norm=.inf", f"optim.clip_norm: {FINITE}"),
        ("precision.loss_scale_max=.inf", f"precision.loss_scale_max: {FINITE}"),
        ("log.peak_tflops=.nan", f"log.peak_tflops: {FINITE} (got nan)"),
        ("data.mixture=[{path: a, weight: .inf}]", f"data.mixture[0].weight: {FINITE}"),
        ("model.rope_scaling={type: linear, factor: .inf}", "factor=inf is not a positive finite"),
    ],
)
def test_numbers_must_be_finite(override, expected):
    """`optim.eps=.inf` loaded, and the run then learned nothing."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_an_infinite_step_timeout_means_no_watchdog_and_round_trips(tmp_path):
    """run.step_timeout_s is the one float key where .inf means something: never time out."""
    config = load_config(None, ["run.step_timeout_s=.inf"])
    assert config.run.step_timeout_s == float("inf")
    saved = tmp_path / "config.yaml"
    saved.write_text(config.to_yaml())
    assert load_config(saved) == config
    with pytest.raises(ConfigError, match=r"run.step_timeout_s: Input should be greater than 0"):
        load_config(None, ["run.step_timeout_s=.nan"])


@pytest.mark.parametrize(
    "override",
    [
        "run.workdir=''",
        "run.name=''",
        "data.path=''",
        "checkpoint.init_from=''",
        "eval.sample_prompts=['']",
        "data.mixture=[{path: '', weight: 1}]",
    ],
)
def test_empty_text_is_refused(override):
    """`run.workdir: ""` wrote checkpoints into the current folder; an empty sample prompt stopped
    the run at its first eval with the fix of another tool (`give a --prompt`)."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert "String should have at least 1 character (got '')" in message
    assert message.endswith("; give it a value, or leave the key out for its default")


def test_a_url_workdir_is_refused():
    """`run.workdir=gs://bucket/run` made a local folder `gs:/bucket/run` and failed at the first
    save with Orbax's traceback."""
    with pytest.raises(ConfigError) as info:
        load_config(None, ["run.workdir=gs://bucket/run"])
    assert str(info.value) == (
        "run.workdir=gs://bucket/run is a URL, and the trainer writes local paths; mount the "
        "bucket (e.g. gcsfuse) at the same path on every host and give that path"
    )


def test_a_negative_seed_is_refused_before_grain_sees_it():
    """Grain raised `expected non-negative integer` with a traceback after the model was built."""
    with pytest.raises(ConfigError, match=r"^run.seed: Input should be greater than or equal to 0"):
        load_config(None, ["run.seed=-1"])
    assert load_config(None, ["run.seed=4294967296"]).run.seed == 2**32


@pytest.mark.parametrize("rule", ["true", "3", "[data, 3]"])
def test_a_sharding_rule_that_is_not_an_axis_name_names_the_rule(rule):
    """The error said `mesh.rules.embed.str: ...`, pydantic's union member in the key."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"mesh.rules={{embed: {rule}}}"])
    assert str(info.value).startswith("mesh.rules.embed=")
    assert "is not a mesh axis; use an axis name, a list of them, or null" in str(info.value)
    assert load_config(None, ["mesh.rules={embed: [data, fsdp], kv: null}"]).mesh.rules == {
        "embed": ["data", "fsdp"],
        "kv": None,
    }


def test_cli_bool_for_steps_exits_2_before_training(repo_root, tmp_path):
    proc = cli(repo_root, "run.steps=true", f"run.workdir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: run.steps: Input should be a valid integer (got true); use a whole number\n"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "optim:\n  lr: 1.0e-3\nrun:\n  steps: 5\noptim:\n  warmup_steps: 5\n",
            "line 5 repeats the key optim (first on line 1), and YAML would keep only the last; "
            "give each key once (a section once, holding all its keys)",
        ),
        ("optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", "line 3 repeats the key lr (first on line 2)"),
    ],
)
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, text, expected):
    """PyYAML keeps the last of a repeated key silently: a second `optim:` section dropped the
    first one's lr, and the run trained at the default."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"config file {path} {expected}")


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("optim:\n  <<: {lr: 1.0e-3, warmup_steps: 3}\n  lr: 2.0e-3\n")
    config = load_config(path)
    assert (config.optim.lr, config.optim.warmup_steps) == (2.0e-3, 3)
    with pytest.raises(ConfigError, match=r"^override model.args=\{a: 1, a: 2\} repeats the key a"):
        load_config(None, ["model.args={a: 1, a: 2}"])


def test_reading_a_config_through_the_package_loads_no_jax(repo_root):
    """`trainer`'s docstring promises it; before, `import trainer` imported flax for
    `annotate_axes` (0.65 s of every `--print-config`). The user-error classes are exported."""
    script = (
        "import sys, trainer\n"
        "trainer.load_config('configs/demo.yaml', ['optim.lr=1e-3'])\n"
        "print(sorted(m for m in ('jax', 'flax', 'grain') if m in sys.modules))\n"
        "from input_pipeline.errors import DataError\n"
        "from trainer import annotate_axes\n"
        "print(trainer.DataError is DataError, callable(annotate_axes))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines() == ["[]", "True True"]
