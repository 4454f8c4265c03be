"""`python -m trainer.plan`: its compiled footprint is the step that really runs, its verdict flips
at the total, a config that does not fit gets a change that was compiled and fits, and bad input
is one line and exit 2. In-process on the test's 8 devices; one CLI run in a subprocess."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from trainer import plan
from trainer.config import load_config
from trainer.data import check_batch_layout
from trainer.errors import ConfigError
from trainer.parallel import sharding
from trainer.parallel.program import build_program
from trainer.plan import main, measure
from trainer.plan.changes import changes, knob_steps, overrides_of
from trainer.plan.report import format_bytes, parse_size, verdict
from trainer.train import builder_for_vocab

TINY = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def tiny(repo_root):
    """The plan's footprint of configs/tiny.yaml on the 8 devices (starting the backend first,
    so the plan finds it running and takes its devices instead of faking a count)."""
    config = load_config(repo_root / TINY)
    return config, measure(config, jax.devices()[:8])


@pytest.fixture(autouse=True)
def in_repo(monkeypatch, repo_root):
    monkeypatch.chdir(repo_root)


# ----------------------------------------------------------------------------- pure pieces


@pytest.mark.parametrize(
    "text, expected",
    [("80GB", 80 * 10**9), ("11GiB", 11 * 2**30), ("512MB", 512 * 10**6), ("1234", 1234)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80XB", "GB", "-1GB", "", "eleven GB"])
def test_parse_size_rejects_what_is_not_a_size(text):
    with pytest.raises(ConfigError, match="is not a size; use e.g. 80GB"):
        parse_size(text)


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 999, 4_574_000, 82.2e9, 1.56e12)] == [
        "0 B",
        "999 B",
        "4.57 MB",
        "82.2 GB",
        "1.56 TB",
    ]


def test_changes_cheapest_first_and_valid():
    """On 8 devices of pure data parallelism: fsdp doublings lead, every accumulation step keeps
    the batch layout, stages divide the layers, and a pair never turns one knob twice."""
    config = load_config(None, ["model.num_layers=6", "data.global_batch_size=64"])
    steps = knob_steps(config, 8)
    found = changes(steps)
    assert overrides_of(found[0]) == ["mesh.stage=1", "mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1"]
    ranks = [sum(step.rank for step in change) for change in found]
    assert ranks == sorted(ranks)
    assert all(len({step.knob for step in change}) == len(change) for change in found)
    accum = [int(s.overrides[0].split("=")[1]) for s in steps if s.knob == "accum"]
    assert accum == [2, 4, 8]  # 64 rows over 8 devices: at most 8 microbatches
    for steps_ in accum:
        check_batch_layout(64, steps_, 8)
    stages = [s.overrides for s in steps if s.knob == "stage"]
    assert stages == [("mesh.stage=2", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1")]


# ----------------------------------------------------------------------------- compiled


def test_plan_total_matches_the_step_that_runs(tiny):
    """Init a real state, run one real step on a real batch, and read the memory analysis of
    that executable: the plan's total (compiled from shapes alone) is within 10% of it."""
    config, planned = tiny
    program = build_program(config, sharding.make_mesh(config.mesh), builder_for_vocab(config, 256))
    rows, length = config.data.global_batch_size, config.data.seq_len
    tokens = np.random.default_rng(0).integers(0, 256, (rows, length + 1)).astype(np.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.ones((rows, length), np.int32),
        "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
        "weights": np.ones((rows, length), np.float32),
    }
    with jax.set_mesh(program.mesh):
        batch = jax.device_put(batch, program.batch_sharding)
        state, metrics = program.train_step(program.init(), batch)
        assert np.isfinite(float(metrics["loss"]))
        ran = program.train_step.lower(state, batch).compile().memory_analysis()
    real = (
        ran.argument_size_in_bytes
        + ran.output_size_in_bytes
        - ran.alias_size_in_bytes
        + ran.temp_size_in_bytes
    )
    assert abs(planned.total - real) <= 0.10 * real, (planned.total, real)
    assert planned.params + planned.opt_state + planned.temporaries < planned.total


def test_verdict_flips_at_the_total(tiny):
    _, planned = tiny
    for budget, answer in [(planned.total + 1, "yes"), (planned.total, "yes")]:
        assert f"per device: {answer}" in verdict(planned.total, budget)
    assert "per device: no" in verdict(planned.total, planned.total - 1)


def test_a_config_that_does_not_fit_gets_a_compiled_change_that_fits(tiny, capsys, monkeypatch):
    """One byte short of the total: the plan says no (exit 1) and suggests a change, which it
    compiled (recorded here) and which fits."""
    _, planned = tiny
    budget = planned.total - 1
    compiled = []

    def measure_and_record(config, devices):
        compiled.append((config, measure(config, devices)))
        return compiled[-1][1]

    monkeypatch.setattr(plan, "measure", measure_and_record)
    assert plan.main(["--config", TINY, "--devices", "8", "--device-memory", str(budget)]) == 1
    out = capsys.readouterr().out
    assert "per device: no" in out
    suggested = out.split("suggested: ")[1].split(" (total")[0].split()
    last_config, last = compiled[-1]
    assert last_config == load_config(TINY, suggested)
    assert last.total <= budget < planned.total


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--device-memory", "80XB"], "error: --device-memory '80XB' is not a size"),
        (["--devices", "16"], "error: --devices 16 is more than the 8 CPU devices"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(flags, message, capsys):
    jax.devices()  # the backend runs, as in any test: 16 devices cannot be faked any more
    assert main(["--config", TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.slow
def test_cli_prints_the_plan(repo_root):
    done = subprocess.run(
        [sys.executable, "-m", "trainer.plan", "--config", TINY, "--devices", "4"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "on 4 devices, mesh stage=1 data=4 fsdp=1 tensor=1" in done.stdout
    assert "fits in 80 GB per device: yes" in done.stdout
