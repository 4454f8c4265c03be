"""metrics.jsonl stays one clean run across resumes; TensorBoard events are written."""

import json

from trainer.metrics import MetricsWriter


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


def test_non_finite_values_stay_valid_json(tmp_path):
    writer = MetricsWriter(tmp_path, total_steps=1, tensorboard=False, progress=False)
    writer.write(1, {"loss": float("nan")})
    writer.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == "nan"
