"""The command-line tools around training (`trainer.export`, `trainer.generate`,
`trainer.report`) on a user's mistakes and damaged files: one line on stderr naming the problem
and the fix, exit code 2, no traceback; and what they write is where they say."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import tiny_run

from trainer import export, generate, report
from trainer.train import run


@pytest.fixture(scope="module")
def workdir(corpus, tmp_path_factory) -> Path:
    """A real run of the tiny model: 2 steps, one checkpoint."""
    path = tmp_path_factory.mktemp("cli") / "run"
    run(tiny_run(corpus, path, steps=2))
    return path


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err.strip()


# ----------------------------------------------------------------------------- export


def test_export_to_a_folder_that_cannot_be_created(workdir, tmp_path, capsys):
    """Refused before any weight is read: Orbax would otherwise fail in its own threads."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for fmt in ("orbax", "hf"):
        argv = ["--workdir", str(workdir), "--out", str(blocker / "out"), "--format", fmt]
        assert export.main(argv) == 2
        assert one_error_line(capsys) == (
            f"error: cannot create --out folder {blocker / 'out'} (Not a directory); "
            "choose a writable folder"
        )
    out = tmp_path / "new" / "params"  # a missing parent is made, as before
    assert export.main(["--workdir", str(workdir), "--out", str(out)]) == 0
    assert (out / "_CHECKPOINT_METADATA").is_file()


# ----------------------------------------------------------------------------- a saved config


def older_run(workdir: Path, copy: Path, section: str, key: str, value) -> Path:
    """A copy of `workdir` whose checkpoint's saved config sets `section.key` to `value`, as a
    version of the trainer with another schema would have saved it; the file edited."""
    shutil.copytree(workdir, copy)
    [meta] = copy.glob("checkpoints/*/meta/metadata")
    saved = json.loads(meta.read_text())
    saved["config"][section][key] = value
    meta.write_text(json.dumps(saved))
    return meta


@pytest.mark.parametrize(
    ("section", "key", "value", "problem"),
    [
        ("model", "old_knob", 1, "unknown key model.old_knob; valid keys: model.kind, "),
        ("data", "seq_len", -1, "data.seq_len: Input should be greater than or equal to 2"),
    ],
    ids=["removed_key", "refused_value"],
)
@pytest.mark.parametrize("tool", ["export", "generate"])
def test_a_saved_config_this_version_refuses_names_its_file(
    workdir, tmp_path, tool, section, key, value, problem, capsys
):
    """Before: the key's line as for a user's own config ("unknown key model.old_knob; valid
    keys: ...", or "did you mean"), naming neither the file it is in nor what to do there."""
    meta = older_run(workdir, tmp_path / "older", section, key, value)
    argv = ["--workdir", str(tmp_path / "older")]
    if tool == "export":
        assert export.main([*argv, "--out", str(tmp_path / "out")]) == 2
    else:
        assert generate.main([*argv, "--prompt", "def", "--max-new-tokens", "2"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(
        f"error: {meta} holds a saved config that this version of the trainer refuses ({problem}"
    ), line
    assert line.endswith("; edit that key in the file, or use the trainer version that saved it")
    assert meta.parent.parent.is_dir(), "the checkpoint stays in place"


# ----------------------------------------------------------------------------- generate


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--temperature", "-1"], "--temperature -1.0 is not a temperature; pass 0 (greedy)"),
        (["--temperature", "nan"], "--temperature nan is not a temperature"),
        (["--top-k", "-5"], "--top-k -5 is negative; pass 0 (no cut)"),
        (["--top-p", "0"], "--top-p 0.0 is outside (0, 1]; pass 1 (no cut)"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0 is not a token count; pass 1 or more"),
        (["--prompt", ""], "--prompt is empty; give some text"),
    ],
)
def test_generate_refuses_settings_that_sample_wrong(workdir, flags, expected, capsys):
    """A negative temperature would invert the distribution, top-p 0 keep no token, and a
    negative top-k fail inside JAX; each is one line before the model is loaded."""
    argv = ["--workdir", str(workdir), "--prompt", "def", "--max-new-tokens", "2", *flags]
    assert generate.main(argv) == 2
    assert one_error_line(capsys).startswith(f"error: {expected}")


def test_generate_with_valid_settings_still_samples(workdir, capsys):
    argv = ["--workdir", str(workdir), "--prompt", "def", "--max-new-tokens", "3"]
    assert generate.main([*argv, "--temperature", "0", "--top-k", "0", "--top-p", "1"]) == 0
    assert capsys.readouterr().out.startswith("def")


# ----------------------------------------------------------------------------- report

LINES = [
    {"step": 1, "loss": 5.5, "lr": 1e-3, "tokens_per_s": 900.0, "step_time_s": 1.0},
    {"step": 2, "loss": 5.1, "lr": 2e-3, "tokens_per_s": 1000.0, "step_time_s": 0.9},
    {"step": 2, "eval_loss": 5.0},
]


def metrics_dir(tmp_path: Path, content: bytes, summary: bytes | None = None) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_bytes(content)
    if summary is not None:
        (folder / "summary.json").write_bytes(summary)
    return folder


GOOD = "".join(json.dumps(line) + "\n" for line in LINES).encode()


@pytest.mark.parametrize(
    "content",
    [
        b"\x83\xff\x00\x9c binary \xfe\n\x01\x02\n\x07",
        b"garbage {{\nmore garbage\n",
        b'{"step": "a", "loss": 1}\n{"step": "b", "loss": 2}\n',
    ],
    ids=["binary", "not_json", "step_not_a_number"],
)
def test_report_on_a_file_that_is_not_metrics(tmp_path, content, capsys):
    folder = metrics_dir(tmp_path, content)
    assert report.main([str(folder)]) == 2
    assert one_error_line(capsys) == (
        f"error: {folder / 'metrics.jsonl'} holds no metrics line (a JSON object with step and "
        "loss); pass the run.workdir of a run that logged a step"
    )


def test_report_skips_damaged_lines_and_a_summary_of_the_wrong_shape(tmp_path, capsys):
    content = GOOD + b"\x83\xff half-written \xfe"
    summary = json.dumps({"fractions": {"step": "x"}, "wall_s": "y"}).encode()
    folder = metrics_dir(tmp_path, content, summary)
    assert report.main([str(folder)]) == 0
    out = capsys.readouterr().out
    assert "run: 2 steps, final loss 5.1000" in out and "time (last session" not in out
    assert (folder / "report.png").is_file()


def test_report_out_paths(tmp_path, capsys):
    """A folder gets report.png inside; a name without a suffix gets .png, as matplotlib writes
    it; the line printed names the file written."""
    folder = metrics_dir(tmp_path, GOOD)
    plots = tmp_path / "plots"
    plots.mkdir()
    for out, written in [(plots, plots / "report.png"), (tmp_path / "cmp", tmp_path / "cmp.png")]:
        assert report.main([str(folder), "--out", str(out)]) == 0
        assert capsys.readouterr().out.endswith(f"wrote {written}\n")
        assert written.is_file()


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ("a_file/report.png", "(a parent is a file); pass --out a writable path"),
        ("report.bar", "matplotlib cannot write .bar files; use .png (or one of"),
    ],
)
def test_report_out_that_cannot_be_written(tmp_path, out, expected, capsys):
    folder = metrics_dir(tmp_path, GOOD)
    (tmp_path / "a_file").write_text("not a folder")
    assert report.main([str(folder), "--out", str(tmp_path / out)]) == 2
    assert expected in one_error_line(capsys)
