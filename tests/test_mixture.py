"""Data mixtures and the hot-data cache: token shares follow the weights, sources must share a
tokenizer, a mixed run resumes bit-exactly after SIGTERM and evaluates every source, and
`data.cache=memory` serves exactly the batches the disk does."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import TINY, documents, same, take

import trainer.data
from input_pipeline.errors import DataError
from input_pipeline.mixture import tokens_by_source
from input_pipeline.prepare import prepare_dataset
from trainer.config import load_config
from trainer.data import dataset_sources
from trainer.errors import ConfigError
from trainer.observe.metrics import read_metrics
from trainer.train import run


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    """A second, differently shaped source with the same (byte) tokenizer."""
    out = tmp_path_factory.mktemp("data") / "prose"
    return prepare_dataset(documents(120, seed=7), out, eval_fraction=0.1, progress=False)


def mixture(code, prose, code_weight=0.75, prose_weight=0.25) -> str:
    return (
        f"data.mixture=[{{path: '{code}', weight: {code_weight}, name: code}}, "
        f"{{path: '{prose}', weight: {prose_weight}, name: prose}}]"
    )


def test_token_shares_follow_the_weights(corpus, prose, tmp_path):
    config = load_config(None, [*TINY, mixture(corpus, prose), f"run.workdir={tmp_path}"])
    sources = dataset_sources(config.data, seed=config.run.seed)
    batches = take(sources.train, 200)
    tokens = tokens_by_source(sources.train.get_state())
    total = sum(tokens.values())
    assert total == sum(b["weights"].sum() for b in batches)
    assert abs(tokens["tokens_code"] / total - 0.75) < 0.02
    assert abs(tokens["tokens_prose"] / total - 0.25) < 0.02
    assert set(sources.make_evals) == {"code", "prose"}


def test_sources_with_different_tokenizers_are_refused_in_one_line(corpus, prose, tmp_path):
    other = tmp_path / "sp"
    shutil.copytree(prose, other)
    info = json.loads((other / "dataset.json").read_text())
    info["tokenizer"] = {"kind": "sentencepiece", "vocab_size": 256, "sha256": "ab" * 32}
    (other / "dataset.json").write_text(json.dumps(info))
    config = load_config(None, [*TINY, mixture(corpus, other), f"run.workdir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"sources 'code' \(byte .*\) and 'prose' \(sentencep"):
        dataset_sources(config.data, seed=config.run.seed)


def test_memory_cache_gives_the_batches_of_the_disk(corpus, tmp_path, monkeypatch):
    args = [*TINY, f"data.path={corpus}", f"run.workdir={tmp_path}"]
    disk = dataset_sources(load_config(None, args).data, seed=0)
    memory = dataset_sources(load_config(None, [*args, "data.cache=memory"]).data, seed=0)
    for a, b in zip(take(disk.train, 8), take(memory.train, 8), strict=True):
        assert same(a, b)
    for a, b in zip(take(disk.make_eval(), 3), take(memory.make_eval(), 3), strict=True):
        assert same(a, b)

    monkeypatch.setattr(trainer.data, "available_memory", lambda: 1 << 10)
    with pytest.raises(DataError, match=r"data.cache=memory needs .* GiB .* available; use"):
        dataset_sources(load_config(None, [*args, "data.cache=memory"]).data, seed=0)


def rows_of(workdir):
    return read_metrics(workdir / "metrics.jsonl").rows


def losses_of(workdir):
    return {r["step"]: r["loss"] for r in rows_of(workdir) if "loss" in r}


# The CLI, held at step 5 until the test's SIGTERM has come. Before: the test sent it once it saw
# 5 steps logged, and the run's other 19 steps take under a second: a test process that a loaded
# machine woke that much later found the run finished at step 24, with nothing left to resume.
HELD_AT_STEP_5 = """
import sys, time
from trainer.main import main
from trainer.preemption import StopRequest

real_at_step, steps = StopRequest.at_step, []

def held_at_step_5(stop):
    steps.append(len(steps) + 1)
    while steps[-1] == 5 and stop.signal_name is None:  # a sleep lets the handler run
        time.sleep(0.01)
    return real_at_step(stop)

StopRequest.at_step = held_at_step_5
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_mixture_resumes_bit_exactly_and_evaluates_every_source(corpus, prose, tmp_path, repo_root):
    args = [
        mixture(corpus, prose),
        "data.cache=memory",
        "run.steps=24",
        "optim.decay_steps=24",
        "checkpoint.every=100",
        "eval.every=12",
        "log.every=1",
    ]
    straight = tmp_path / "straight"
    run(load_config(repo_root / "configs/tiny.yaml", [*args, f"run.workdir={straight}"]))
    expected = losses_of(straight)
    evals = [r for r in rows_of(straight) if "eval_loss" in r]
    assert len(evals) == 2 and all("eval_loss_code" in r and "eval_loss_prose" in r for r in evals)
    last = [r for r in rows_of(straight) if "tokens_code" in r][-1]
    assert last["tokens_code"] == 3 * last["tokens_prose"]  # 12 of 16 rows each step

    workdir = tmp_path / "stopped"
    cli = ["--config", "configs/tiny.yaml", *args, f"run.workdir={workdir}"]
    held = [sys.executable, "-c", HELD_AT_STEP_5, *cli]
    proc = subprocess.Popen(held, cwd=repo_root, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240  # lines 1-3 are written before step 5's stop check
        while not ((workdir / "metrics.jsonl").exists() and len(losses_of(workdir)) >= 3):
            assert time.monotonic() < deadline and proc.poll() is None, "never trained 3 steps"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()  # held at step 5 for good, if the test failed before its SIGTERM
    assert proc.returncode == 0, stderr[-2000:]
    stopped_at = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert stopped_at == 5, stderr[-2000:]

    # the resume, through the library in this process (an error raises): the stop is what needs
    # a process of its own, and a new one makes the resume seconds longer
    run(load_config(repo_root / "configs/tiny.yaml", [*args, f"run.workdir={workdir}"]))
    got = losses_of(workdir)
    assert [got[s] for s in range(stopped_at + 1, 25)] == [
        expected[s] for s in range(stopped_at + 1, 25)
    ]
    final = [r for r in rows_of(workdir) if "tokens_code" in r][-1]
    assert (final["tokens_code"], final["tokens_prose"]) == (
        last["tokens_code"],
        last["tokens_prose"],
    )


def test_a_missing_source_is_named_by_its_mixture_key(corpus, tmp_path):
    """Before: the error blamed data.path, which a mixture run does not set."""
    config = load_config(None, [*TINY, mixture(corpus, tmp_path / "gone")])
    with pytest.raises(DataError, match=r"^data.mixture\[1\].path=.*gone does not exist"):
        dataset_sources(config.data, seed=0)


def test_a_source_without_eval_split_is_said_at_the_start(corpus, tmp_path, capsys):
    """Before: eval_loss silently averaged only the sources that have an eval split."""
    no_eval = prepare_dataset(documents(40, seed=5), tmp_path / "noeval", eval_fraction=0)
    capsys.readouterr()
    config = load_config(None, [*TINY, mixture(corpus, no_eval)])
    sources = dataset_sources(config.data, seed=0)
    assert set(sources.make_evals) == {"code"}
    err = capsys.readouterr().err
    assert (
        "data.mixture sources prose have no eval split; eval_loss is the weighted mean of code"
        in err
    )
