"""Where the time goes: the goodput breakdown names the bottleneck (slow data vs steps), a profile
window leaves a trace, `trainer.report` draws runs from their workdirs, and the console shows
step, loss, tokens/s and ETA. Two short real trainings serve all of it (module fixture)."""

import gzip
import io
import itertools
import json
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TINY

import trainer
from trainer import report
from trainer.observe.goodput import BUCKETS, Goodput, format_summary
from trainer.observe.metrics import MetricsWriter

VOCAB, ROWS, LEN = 64, 16, 64  # TINY's global batch and sequence length
SLOW_S = 0.75  # per batch: many times a tiny step even on a loaded machine (where one took 46 ms)
COMPILE = "/jax/core/compile/backend_compile_duration"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timers_split_the_wall_time_and_compiles_move_to_their_own_bucket():
    clock = FakeClock()
    with Goodput(clock) as goodput:
        with goodput.timing("data_wait"):
            clock.now += 2.0
        with goodput.timing("step"):
            clock.now += 1.0
            assert goodput.seconds()["step"] == 1.0  # an open timer counts up to now
            clock.now += 4.0
            jax.monitoring.record_event_time_span(COMPILE, 100.0, 103.0)
            # a trace nested inside that compile counts once
            jax.monitoring.record_event_time_span(
                "/jax/core/compile/jaxpr_trace_duration", 100.5, 101.0
            )
            thread = threading.Thread(  # compiles on other threads overlap the loop's time
                target=jax.monitoring.record_event_time_span, args=(COMPILE, 0.0, 50.0)
            )
            thread.start()
            thread.join()
            with goodput.timing("checkpoint"):
                clock.now += 1.0
        clock.now += 0.5  # no timer: other, less the compile below
        jax.monitoring.record_event_time_span(COMPILE, 10.0, 10.25)
    clock.now += 100.0  # after the session closed: neither counted nor listened to
    jax.monitoring.record_event_time_span(COMPILE, 200.0, 230.0)
    assert goodput.wall_s() == 8.5
    assert goodput.seconds() == {
        "compile": 3.25,
        "step": 2.0,
        "data_wait": 2.0,
        "checkpoint": 1.0,
        "eval": 0.0,
        "other": 0.25,
    }
    fields = goodput.metrics()
    assert fields["goodput"] == 2.0 / 8.5 and fields["goodput_data_wait_s"] == 2.0
    with pytest.raises(ValueError, match="unknown goodput bucket 'stepp'"), goodput.timing("stepp"):
        pass


# ----------------------------------------------------------------------------- real runs


def token_batches():
    """Learnable LM batches (each row counts up from a random offset), host numpy arrays."""
    rng = np.random.default_rng(0)
    for _ in itertools.count():
        tokens = (rng.integers(0, VOCAB, (ROWS, 1)) + np.arange(LEN + 1)) % VOCAB
        yield {
            "inputs": tokens[:, :-1].astype(np.int32),
            "targets": tokens[:, 1:].astype(np.int32),
            "weights": np.ones((ROWS, LEN), np.float32),
        }


def sleepy(batch):
    time.sleep(SLOW_S)
    return batch


def train(workdir: Path, steps: int, data, overrides=(), eval_data=None) -> None:
    config = trainer.load_config(
        None,
        [
            *TINY,
            "model.num_layers=1",  # compiles in half the time of TINY's two
            "model.d_ff=64",
            f"run.workdir={workdir}",
            f"run.steps={steps}",
            f"model.vocab_size={VOCAB}",
            "log.every=2",
            "log.tensorboard=false",
            "checkpoint.every=1000",  # one save, at the end
            f"eval.every={steps}",
            *overrides,
        ],
    )
    trainer.run(config, data=data, eval_data=eval_data)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """`fast`: in-memory batches, an eval, a profiled window; `slow`: a map that sleeps."""
    root = tmp_path_factory.mktemp("goodput")
    eval_batches = list(itertools.islice(token_batches(), 2))
    train(root / "fast", 12, token_batches(), ["log.profile_steps=[3,5]"], eval_batches)
    train(root / "slow", 10, map(sleepy, token_batches()))
    return {"fast": root / "fast", "slow": root / "slow"}


def summary_of(workdir: Path) -> dict:
    return json.loads((workdir / "summary.json").read_text())


@pytest.mark.slow
def test_slow_data_is_blamed_on_data_waiting_and_fast_data_on_steps(runs):
    slow, fast = summary_of(runs["slow"]), summary_of(runs["fast"])
    for summary in (slow, fast):
        seconds = summary["seconds"]
        assert set(seconds) == set(BUCKETS)
        assert sum(seconds.values()) == pytest.approx(summary["wall_s"], rel=1e-6)
        assert seconds["compile"] > 0 and seconds["checkpoint"] > 0
        assert summary["tokens"] == summary["steps"] * ROWS * LEN
        assert summary["tokens_per_s"] > summary["tokens_per_s_wall"] > 0
        assert summary["mfu"] is None  # CPU: no known peak
        if jax.local_devices()[0].memory_stats() is None:
            assert summary["peak_memory_bytes"] is None
    # the device feed holds ~3 batches ahead, filled while step 1 compiles; the rest is waited for
    assert slow["seconds"]["data_wait"] > 0.5 * (slow["steps"] - 4) * SLOW_S
    assert slow["seconds"]["data_wait"] > 2 * slow["seconds"]["step"]
    # A CPU test run is mostly compile; of the step loop's own time, most went to waiting for
    # data. `other` (setup: building the program, the data sources) is left out: it grows with
    # the machine's load, not with the data, and once outweighed 1.1 s of waiting in CI.
    loop = {k: slow["seconds"][k] for k in ("step", "data_wait", "checkpoint", "eval")}
    assert max(loop, key=loop.get) == "data_wait"
    assert loop["data_wait"] > 0.5 * sum(loop.values())
    assert fast["seconds"]["step"] > fast["seconds"]["data_wait"]
    assert fast["seconds"]["eval"] > 0 and slow["seconds"]["eval"] == 0
    table = format_summary(slow)
    assert "data_wait" in table and "n/a" in table


@pytest.mark.slow
def test_metrics_lines_carry_cumulative_goodput(runs):
    lines = [json.loads(x) for x in (runs["slow"] / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train_lines] == [2, 4, 6, 8, 10]
    for row in train_lines:
        assert {"lr", "tokens_per_s", "step_time_s", "data_wait_frac"} <= set(row)
        parts = sum(row[f"goodput_{b}_s"] for b in BUCKETS)
        assert parts == pytest.approx(row["goodput_wall_s"], rel=1e-6)
    walls = [r["goodput_wall_s"] for r in train_lines]
    assert walls == sorted(walls)
    assert train_lines[-1]["data_wait_frac"] > 0.5  # per-step view agrees with the breakdown


@pytest.mark.slow
def test_profile_window_writes_a_trace_of_the_steps(runs):
    profile = runs["fast"] / "profile"
    assert list(profile.rglob("*.xplane.pb")), "no TensorBoard trace"
    traces = list(profile.rglob("*.trace.json.gz"))
    assert traces, "no Perfetto trace"
    assert b"train_step" in gzip.decompress(traces[0].read_bytes())
    assert not (runs["slow"] / "profile").exists()  # no window, no profiler


@pytest.mark.slow
def test_report_draws_two_runs_and_prints_their_summary(runs, tmp_path, capsys):
    out = tmp_path / "cmp.png"
    assert report.main([str(runs["fast"]), str(runs["slow"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fast: 12 steps, final loss" in printed and "slow: 10 steps" in printed
    assert "best eval loss" in printed and "mean tokens/s" in printed
    assert "data_wait" in printed and f"wrote {out}" in printed
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    assert (height, width) == (800, 1500)


def test_report_of_a_workdir_without_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'nope'} does not exist; pass the run.workdir of a run that "
        "logged a step\n"
    )
    assert report.main([str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "eval_loss": 1.0}\n{"step": 3, "lo')
    assert report.main([str(tmp_path)]) == 2
    assert "no training lines" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream", [io.StringIO(), Terminal()], ids=["plain", "tty"])
def test_console_shows_step_loss_tokens_per_s_and_eta(tmp_path, stream):
    writer = MetricsWriter(tmp_path, total_steps=10, tensorboard=False, stream=stream)
    for step in (2, 4):
        time.sleep(0.01)
        writer.write(step, {"loss": 2.5, "tokens_per_s": 1234.0, "step_time_s": 0.1})
    writer.close()
    text = stream.getvalue()
    assert "loss=2.5" in text and "tokens_per_s=1234" in text
    if isinstance(stream, Terminal):
        assert "4/10" in text and "<00:0" in text  # tqdm's bar: step/total [elapsed<remaining]
    else:
        first, second = text.splitlines()
        assert first.startswith("step 2:") and first.endswith("eta=0m01s")  # 8 x 0.1 s
        assert second.startswith("step 4:") and " eta=0m0" in second


@pytest.mark.parametrize(
    "value, problem",
    [("[5,5]", "needs 1 <= start < end"), ("[0,2]", "needs 1"), ("[3]", "not two step numbers")],
)
def test_profile_steps_must_be_a_window(value, problem):
    with pytest.raises(trainer.ConfigError, match=rf"log.profile_steps=.*{problem}"):
        trainer.load_config(None, [f"log.profile_steps={value}"])
