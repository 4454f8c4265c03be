"""metrics.jsonl stays one clean run across resumes; TensorBoard events are written; the report
labels runs by `run.name`."""

import io
import json
import os
from pathlib import Path

import pytest

from trainer import report
from trainer.observe.metrics import MetricsWriter, last_logged, read_metrics


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


def row_bytes(step: int) -> bytes:
    """A whole metrics line, as the writer writes it."""
    return (json.dumps({"step": step, "loss": 1.0 / step}) + "\n").encode()


def test_resume_drops_garbage_lines_keeps_the_rows_and_says_so(tmp_path):
    # What a crash or a bad disk can leave mid-file: bytes that are not UTF-8, a run of NULs,
    # JSON that is no row. Before, the first crashed the resume with a UnicodeDecodeError; then
    # they were dropped without a word.
    path = tmp_path / "metrics.jsonl"
    row = row_bytes
    path.write_bytes(row(1) + b"\xff\xfe{\x00\n" + row(2) + b"\x00" * 64 + b"\n[2]\n" + row(3))
    console = io.StringIO()
    writer = MetricsWriter(
        tmp_path, total_steps=10, start_step=3, tensorboard=False, stream=console
    )
    writer.write(4, {"loss": 0.25})
    writer.close()
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert console.getvalue().splitlines()[0] == (
        f"warning: {path}: lines 2, 4, 5 are not metrics rows (a JSON object with an integer "
        "step); dropped from the resumed log"
    )


def test_resume_past_a_row_whose_step_is_not_a_number(tmp_path):
    """Before: a TypeError traceback (`"a" <= 2`) at start-up, and the run never resumed."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(row_bytes(1) + b'{"step": "a", "loss": 1.0}\n' + row_bytes(2))
    console = io.StringIO()
    writer = MetricsWriter(
        tmp_path, total_steps=10, start_step=2, tensorboard=False, stream=console
    )
    writer.write(3, {"loss": 0.5})
    writer.close()
    assert [r["step"] for r in read_metrics(path).rows] == [1, 2, 3]
    assert console.getvalue().startswith(f"warning: {path}: line 2 is not a metrics row (")


def test_resume_keeps_a_whole_last_row_that_only_lacks_its_newline(tmp_path):
    """The row of the checkpointed step, cut off before its newline, is whole: before, the
    resume dropped it, and the steps after it never log it again."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(row_bytes(1) + row_bytes(2).rstrip(b"\n"))
    writer = MetricsWriter(tmp_path, total_steps=10, start_step=2, tensorboard=False)
    writer.write(3, {"loss": 0.5})
    writer.close()
    assert [r["step"] for r in read_metrics(path).rows] == [1, 2, 3]
    assert path.read_bytes() == row_bytes(1) + row_bytes(2) + b'{"step": 3, "loss": 0.5}\n'


def test_the_reader_leaves_out_a_cut_off_last_line_and_numbers_the_damage(tmp_path):
    path = tmp_path / "metrics.jsonl"
    damage = b"".join(b"oops\n" + row_bytes(s) for s in range(1, 8))  # lines 1, 3, ..., 13
    path.write_bytes(damage + b"\n" + row_bytes(8) + b'{"step": 9, "lo')  # a blank line, a cut
    log = read_metrics(path)
    assert [r["step"] for r in log.rows] == list(range(1, 9))
    assert [line.number for line in log.lines] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert log.damaged == [1, 3, 5, 7, 9, 11, 13]
    assert log.damage() == (
        f"{path}: lines 1, 3, 5, 7, 9 and 2 more are not metrics rows (a JSON object with an "
        "integer step)"
    )
    path.write_bytes(row_bytes(1) + b'{"step": 2, "lo')  # what a kill mid-write leaves
    assert read_metrics(path).damage() is None
    assert last_logged(tmp_path, "loss") == 1.0


UNREADABLE = ["no_permission", "read_fails"]


def make_unreadable(path: Path, how: str) -> None:
    """`path` as a file that exists but whose read fails: without read permission (which root
    ignores: skipped then), or a link to /proc/self/mem, whose first page is never mapped (EIO,
    for root too)."""
    if how == "no_permission":
        path.write_text('{"step": 1, "loss": 2.0}\n')
        path.chmod(0o200)
        if os.access(path, os.R_OK):
            pytest.skip("this user reads files without read permission (root)")
    else:
        if not Path("/proc/self/mem").is_file():
            pytest.skip("needs Linux /proc")
        path.symlink_to("/proc/self/mem")


def test_a_metrics_file_that_cannot_be_read_on_resume_is_one_line(tmp_path):
    """A folder in its place used to be "cannot write ...; make it writable": it is a read that
    fails (a file without read permission too), and making it writable would not do."""
    from trainer.errors import TrainingError

    (tmp_path / "metrics.jsonl").mkdir()
    expected = (
        r"^cannot read .*metrics.jsonl to resume its log: Is a directory; make it a readable "
    )
    with pytest.raises(TrainingError, match=expected):
        MetricsWriter(tmp_path, total_steps=10, start_step=2, tensorboard=False)


@pytest.mark.parametrize("how", UNREADABLE)
def test_an_unreadable_metrics_file_on_resume_is_one_line(tmp_path, how):
    from trainer.errors import TrainingError

    make_unreadable(tmp_path / "metrics.jsonl", how)
    with pytest.raises(TrainingError, match=r"^cannot read .*metrics.jsonl to resume its log: "):
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


def test_report_names_damaged_lines_in_one_warning_and_plots_the_rest(tmp_path, capsys):
    """Before: lines in the middle that are no row were skipped without a word."""
    workdir = tmp_path / "run"
    _logged_run(workdir, None)
    with (workdir / "metrics.jsonl").open("ab") as log:
        log.write(b"\x00\x00\x00\n" + row_bytes(2) + b'{"step": 3, "lo')
    assert report.main([str(workdir)]) == 0
    err = capsys.readouterr().err
    assert err == (
        f"warning: {workdir / 'metrics.jsonl'}: line 2 is not a metrics row (a JSON object "
        "with an integer step); skipped\n"
    )


def test_report_on_a_file_of_one_damaged_line_says_it_holds_no_metrics(tmp_path, capsys):
    """Before: the one line, ended by its newline, was taken for a run's half-written last
    line, and the report said to wait for the first log step."""
    (tmp_path / "metrics.jsonl").write_bytes(b"\x00" * 32 + b"\n")
    assert report.main([str(tmp_path)]) == 2
    assert "holds no metrics line" in capsys.readouterr().err


def test_report_tells_apart_runs_of_the_same_name_by_path(tmp_path):
    _logged_run(tmp_path / "x" / "demo", "demo")
    _logged_run(tmp_path / "y", "demo")
    runs = report.load_runs([tmp_path / "x" / "demo", tmp_path / "y"])
    assert [r.label for r in runs] == [str(tmp_path / "x" / "demo"), str(tmp_path / "y")]


@pytest.mark.parametrize("how", UNREADABLE)
def test_report_on_an_unreadable_metrics_file_is_one_line(tmp_path, how, capsys):
    """Before: an OSError traceback."""
    path = tmp_path / "metrics.jsonl"
    make_unreadable(path, how)
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read {path} (") and err.count("\n") == 1, err
    assert err.endswith(
        "); make it readable, or pass the run.workdir of a run that logged a step\n"
    )


def test_report_says_what_stands_in_place_of_the_metrics_file(tmp_path, capsys):
    """Before: "has no metrics.jsonl" of a workdir that has one, a folder or a broken link."""
    folder, link = tmp_path / "folder", tmp_path / "link"
    (folder / "metrics.jsonl").mkdir(parents=True)
    link.mkdir()
    (link / "metrics.jsonl").symlink_to(tmp_path / "gone.jsonl")
    fix = "; pass the run.workdir of a run that logged a step\n"
    assert report.main([str(folder)]) == 2
    assert capsys.readouterr().err == f"error: {folder / 'metrics.jsonl'} is not a file{fix}"
    assert report.main([str(link)]) == 2
    assert capsys.readouterr().err == (
        f"error: {link / 'metrics.jsonl'} is a link to {tmp_path / 'gone.jsonl'}, which leads to "
        f"no file{fix}"
    )


def test_report_labels_a_run_whose_config_is_not_text_by_its_folder(tmp_path):
    """Before: a UnicodeDecodeError traceback from reading config.yaml for the label."""
    _logged_run(tmp_path / "a", None)
    (tmp_path / "a" / "config.yaml").write_bytes(b"run:\n  name: \xff\xfe\n")
    assert [r.label for r in report.load_runs([tmp_path / "a"])] == ["a"]
