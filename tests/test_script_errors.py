"""What a user runs besides the CLI (examples/, benchmarks/, launch/) answers a mistake with one
line and exit code 2, never a traceback, and runs from any working directory."""

import os
import shutil
import subprocess
import sys

import pytest

USAGE_EXIT = 2


def run(args, cwd, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or os.environ
    )


def assert_one_line(done: subprocess.CompletedProcess, text: str) -> None:
    """Exit 2, no traceback, and `text` in the last line of stderr."""
    assert done.returncode == USAGE_EXIT, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert text in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--steps", "0"], "argument --steps: 0 is not a whole number >= 1"),
        (["--workdir", "{file}"], "argument --workdir: cannot make {file}/data (Not a directory)"),
    ],
)
def test_digits_example_refuses_a_bad_argument(repo_root, tmp_path, args, text):
    file = tmp_path / "a-file"
    file.write_text("")
    argv = [arg.format(file=file) for arg in args]
    done = run([sys.executable, "examples/digits_classifier.py", *argv], repo_root)
    assert_one_line(done, text.format(file=file))


@pytest.mark.parametrize("error", ["ConfigError", "DataError", "TrainingError"])
def test_digits_example_ends_a_trainer_error_in_one_line(repo_root, monkeypatch, capsys, error):
    """Before: `--workdir` holding another model's checkpoint (TrainingError) was a traceback."""
    import trainer

    monkeypatch.syspath_prepend(str(repo_root / "examples"))
    import digits_classifier

    def fails() -> None:
        raise getattr(trainer, error)("checkpoint W/2 is from another model; use a new run.workdir")

    monkeypatch.setattr(digits_classifier, "main", fails)
    assert digits_classifier.cli() == USAGE_EXIT
    assert capsys.readouterr().err == (
        "error: checkpoint W/2 is from another model; use a new run.workdir\n"
    )


@pytest.mark.parametrize(
    ("override", "text"),
    [
        ("model.dropout=0.2", "model.dropout=0.2: this parallel block"),
        ("model.remat=full", "model.remat=full: this parallel block"),
        ("model.attention=cudnn", "model.attention=cudnn: this parallel block"),
    ],
)
def test_parallel_block_refuses_what_it_would_ignore(repo_root, monkeypatch, override, text):
    """It has no dropout: `model.dropout=0.2` trained without any and said nothing (the same
    eval loss as without it)."""
    import jax.numpy as jnp
    from flax import nnx

    from trainer.config import load_config
    from trainer.errors import ConfigError

    monkeypatch.syspath_prepend(str(repo_root / "examples"))
    from parallel_block import build

    config = load_config(repo_root / "configs/tiny.yaml", [override])
    with pytest.raises(ConfigError, match="does not implement it; set ") as refused:
        build(
            config.model,
            vocab_size=256,
            rngs=nnx.Rngs(0),
            compute_dtype=jnp.float32,
            param_dtype=jnp.float32,
        )
    assert str(refused.value).startswith(text)


@pytest.mark.parametrize(
    ("script", "args", "text"),
    [
        ("checkpoint.py", ["--config", "configs/nope.yaml"], "error: config file configs/nope"),
        ("matmul_backward.py", ["--config", "configs/nope.yaml"], "error: config file"),
        ("input_pipeline.py", ["--config", "configs/nope.yaml"], "error: config file"),
        ("train_step.py", ["--configs", "configs/nope.yaml"], "error: config file"),
        ("matmul_backward.py", ["--rounds", "0"], "--rounds: 0 is not a whole number >= 1"),
        ("loop_overhead.py", ["--shapes", "0x64"], "--shapes: 0 is not a whole number >= 1"),
        ("pipeline.py", ["--stages", "3"], "--stages: 3 does not divide the 4 devices; use"),
        (
            "packing_padding.py",
            ["--corpora", "{tmp}/none", "--seq-lens", "64", "--bounds", "2"],
            "error: data.path={tmp}/none does not exist",
        ),
        ("prepare.py", ["--workers", "-1"], "--workers: -1 is not a whole number >= 0"),
    ],
)
def test_benchmark_mistake_is_one_line(repo_root, tmp_path, script, args, text):
    argv = [arg.format(tmp=tmp_path) for arg in args]
    done = run([sys.executable, f"benchmarks/{script}", *argv], repo_root)
    assert_one_line(done, text.format(tmp=tmp_path))


def test_benchmark_configs_are_found_from_another_folder(repo_root, tmp_path, monkeypatch):
    """loop_overhead.py has no --config: it read `configs/*.yaml` from the current folder, and
    failed anywhere but the repository root."""
    from benchmarks._cli import repo_file

    monkeypatch.chdir(tmp_path)
    assert repo_file("configs/demo.yaml") == str(repo_root / "configs/demo.yaml")
    monkeypatch.chdir(repo_root)
    assert repo_file("configs/demo.yaml") == "configs/demo.yaml"  # as BENCHMARKS.md prints it


@pytest.mark.slow
def test_prepare_benchmark_reads_its_relative_dir_from_the_callers_folder(repo_root, tmp_path):
    """--dir relative to where it is started (prepare once ran in the repository root, and
    found no input there)."""
    args = ["--sizes-gb", "0.001", "--workers", "1", "--file-mb", "1", "--dir", "scratch"]
    done = run([sys.executable, repo_root / "benchmarks/prepare.py", *args], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    row = done.stdout.strip().splitlines()[-1].split()
    assert row[:2] == ["0.001", "1"] and float(row[4]) > 0  # size, workers, ..., Mtokens/s


def test_local_launcher_names_the_fix_for_an_unknown_device(repo_root):
    env = {**os.environ, "LOCAL_DEVICE": "tpu"}
    done = run(["bash", "launch/local.sh", "2", "--config", "configs/tiny.yaml"], repo_root, env)
    assert_one_line(done, "LOCAL_DEVICE=tpu is neither cpu nor gpu; set it to one of them")


def test_slurm_script_outside_slurm_says_to_submit_it(repo_root):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = run(["bash", "launch/slurm.sbatch", "run.steps=1"], repo_root, env)
    assert_one_line(done, "not inside a Slurm job; submit it: sbatch launch/slurm.sbatch")


def test_tpu_launcher_without_gcloud_says_so(repo_root, tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no gcloud (and nothing else) on PATH
    done = run(
        [shutil.which("bash"), "launch/tpu_pod.sh", "my-tpu", "us-central2-b"], repo_root, env
    )
    assert_one_line(done, "gcloud is not a command here; install the Google Cloud CLI")
