"""metrics.jsonl stays one clean run across resumes; TensorBoard events are written; the report
labels runs by `run.name`."""

import io
import json

import pytest

from trainer import report
from trainer.observe.metrics import MetricsWriter


def test_resume_drops_lines_past_the_checkpoint_and_half_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    writer = MetricsWriter(tmp_path, total_steps=10, start_step=2, tensorboard=True, progress=False)
    writer.write(3, {"loss": 0.5, "lr": 0.1})
    writer.close()
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[-1]["loss"] == 0.5
    assert any((tmp_path / "tb").iterdir())


def test_resume_drops_garbage_lines_and_keeps_the_rows(tmp_path):
    # What a crash or a bad disk can leave mid-file: bytes that are not UTF-8, a run of NULs,
    # JSON that is no row. Before, the first crashed the resume with a UnicodeDecodeError.
    path = tmp_path / "metrics.jsonl"
    row = lambda s: (json.dumps({"step": s, "loss": 1.0 / s}) + "\n").encode()  # noqa: E731
    path.write_bytes(row(1) + b"\xff\xfe{\x00\n" + row(2) + b"\x00" * 64 + b"\n[2]\n" + row(3))
    writer = MetricsWriter(tmp_path, total_steps=10, start_step=3, tensorboard=False)
    writer.write(4, {"loss": 0.25})
    writer.close()
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4]


def test_a_metrics_file_that_cannot_be_written_is_one_line(tmp_path):
    from trainer.errors import TrainingError

    (tmp_path / "metrics.jsonl").mkdir()  # e.g. another user's file: not writable
    with pytest.raises(TrainingError, match=r"^cannot write .*metrics.jsonl: Is a directory; "):
        MetricsWriter(tmp_path, total_steps=10, start_step=2, tensorboard=False)


def test_non_finite_values_stay_valid_json(tmp_path):
    writer = MetricsWriter(tmp_path, total_steps=1, tensorboard=False, progress=False)
    writer.write(1, {"loss": float("nan")})
    writer.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == "nan"


class Terminal(io.StringIO):
    """A console the writer takes for a terminal: it draws a progress bar there."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream", [io.StringIO, Terminal], ids=["plain", "terminal"])
def test_a_row_with_nothing_for_the_console_prints_no_line(tmp_path, stream):
    """A checkpoint's row (`ckpt_block_s` only) goes to metrics.jsonl, never as `step 100: `."""
    console = stream()
    writer = MetricsWriter(tmp_path, total_steps=200, tensorboard=False, stream=console)
    writer.write(100, {"eval_loss": 2.5})
    writer.write(100, {"ckpt_block_s": 0.25})
    writer.close()
    lines = [line.strip() for line in console.getvalue().replace("\r", "\n").splitlines()]
    assert [line for line in lines if line.startswith("step ")] == ["step 100: eval_loss=2.5"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 100, "eval_loss": 2.5}, {"step": 100, "ckpt_block_s": 0.25}]


def test_the_console_shows_skipped_steps_once_there_are_some(tmp_path):
    """An fp16 run skipping every step printed lines like a healthy one; metrics.jsonl alone
    held `skipped_steps`."""
    console = io.StringIO()
    writer = MetricsWriter(tmp_path, total_steps=200, tensorboard=False, stream=console)
    writer.write(10, {"loss": 2.5, "skipped_steps": 0})
    writer.write(20, {"loss": 2.5, "skipped_steps": 3})
    writer.close()
    lines = [line.split(" eta=")[0] for line in console.getvalue().splitlines()]
    assert lines == ["step 10: loss=2.5", "step 20: loss=2.5 skipped_steps=3"]


def _logged_run(workdir, name: str | None) -> None:
    workdir.mkdir(parents=True)
    (workdir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    if name is not None:
        (workdir / "config.yaml").write_text(f"run:\n  name: {name}\n  workdir: {workdir}\n")


def test_report_labels_runs_by_run_name_else_folder(tmp_path):
    _logged_run(tmp_path / "a", "lr-sweep-1")
    _logged_run(tmp_path / "b", "run")  # the default name says nothing: the folder does
    _logged_run(tmp_path / "c", None)  # no config.yaml
    runs = report.load_runs([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    assert [r.label for r in runs] == ["lr-sweep-1", "b", "c"]


def test_report_tells_apart_runs_of_the_same_name_by_path(tmp_path):
    _logged_run(tmp_path / "x" / "demo", "demo")
    _logged_run(tmp_path / "y", "demo")
    runs = report.load_runs([tmp_path / "x" / "demo", tmp_path / "y"])
    assert [r.label for r in runs] == [str(tmp_path / "x" / "demo"), str(tmp_path / "y")]
