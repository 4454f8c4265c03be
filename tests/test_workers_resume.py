"""A data position resumes with the `data.workers` that saved it, bit-exactly, and only with it
(and with its `data.packing`, reader and mixture).

Each Grain worker packs its own share of the reads (every `workers`-th), so a position saved with
W workers is no position of any other count. Before: resuming with another count was a KeyError
or IndexError traceback from deep inside Grain or the packer (exit 1), whichever way it changed
(0 -> 2, 2 -> 0, 2 -> 4). Now it is one line naming both counts and the fix, exit 2, with the
checkpoint left in place. Positions saved before the count was recorded (Grain's interleave of
one iterator per worker, or the packer's own) still resume with their own count. Another
`data.packing`, reader, or a mixture against one dataset were tracebacks too; now one line each.
"""

import copy
import subprocess

import pytest
from conftest import SHARED_SCHEDULE, same, take, tiny_cli, tiny_in_process

from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.mixture import MixedStream
from input_pipeline.pipeline import make_batch_iterator
from input_pipeline.reading import Reading
from input_pipeline.streams import close_readers


def batches(info, workers: int):
    return make_batch_iterator(
        info, "train", seq_len=64, batch_size=4, reading=Reading(workers=workers, seed=5)
    )


@pytest.fixture(scope="module")
def two_workers(corpus):
    """A data.workers=2 iterator's position after 3 batches, and the 2 batches after it."""
    iterator = batches(load_dataset_info(corpus), 2)
    try:
        take(iterator, 3)
        state = copy.deepcopy(iterator.get_state())
        after = take(iterator, 2)
    finally:
        close_readers(iterator)
    return state, after


def test_a_position_resumes_bit_exactly_with_its_own_worker_count(corpus, two_workers):
    state, after = two_workers
    assert state["workers"] == 2
    old = state["batches"]  # a checkpoint from before the count was recorded: Grain's own state
    for saved in (state, old):
        resumed = batches(load_dataset_info(corpus), 2)
        try:
            resumed.set_state(copy.deepcopy(saved))
            assert all(same(a, b) for a, b in zip(take(resumed, 2), after, strict=True))
        finally:
            close_readers(resumed)


def test_another_worker_count_is_refused_in_one_line(corpus, two_workers):
    info = load_dataset_info(corpus)
    state, _ = two_workers
    single = batches(info, 0)
    zero_state = single.get_state()
    close_readers(single)
    cases = [
        (state, 0, 2),  # was: KeyError 'parent' in the packer
        (state["batches"], 0, 2),
        (state, 4, 2),  # was: IndexError in Grain's interleave
        (zero_state, 2, 0),  # was: KeyError 'exhausted' in Grain's interleave
        (zero_state["batches"], 1, 0),
    ]
    for saved, workers, saved_workers in cases:
        iterator = batches(info, workers)  # not started: set_state refuses before any reads
        with pytest.raises(DataError) as refused:
            iterator.set_state(copy.deepcopy(saved))
        line = str(refused.value)
        assert f"saved with data.workers={saved_workers} " in line
        assert f"data.workers={workers} " in line
        assert f"; set data.workers={saved_workers} to resume" in line
        assert "checkpoint.init_from" in line and "\n" not in line
        close_readers(iterator)


def test_another_packing_reader_or_mixture_is_refused_in_one_line(corpus):
    """Before: KeyError 'parent', 'tf_iterator' or 'sources' tracebacks."""
    info = load_dataset_info(corpus)
    concat = batches(info, 0)
    first_fit = make_batch_iterator(info, "train", seq_len=64, batch_size=4, packing="first_fit")
    saved = concat.get_state()
    with pytest.raises(DataError, match=r"saved with data.packing=concat .*; set data.packing="):
        first_fit.set_state(copy.deepcopy(saved))
    with pytest.raises(DataError, match=r"saved with data.packing=concat .*; set data.packing="):
        first_fit.set_state(copy.deepcopy(saved["batches"]))  # from before the layout was kept
    with pytest.raises(DataError, match=r"data.reader=tfdata and does not carry over to Arr"):
        concat.set_state({**saved, "reader": "tfdata"})
    mixture = MixedStream({"a": batches(info, 0), "b": batches(info, 0)}, {"a": 3, "b": 1}, 4)
    with pytest.raises(DataError, match=r"data.mixture of \['a', 'b'\], but this run reads one"):
        concat.set_state(mixture.get_state())
    with pytest.raises(DataError, match=r"position is of one dataset, but data.mixture names"):
        mixture.set_state(saved)
    assert same(next(concat), next(batches(info, 0)))  # nothing moved: it reads from the top


def test_a_refused_mixture_position_leaves_the_mixture_as_it_was(corpus):
    info = load_dataset_info(corpus)
    mixture = MixedStream({"a": batches(info, 0), "b": batches(info, 0)}, {"a": 3, "b": 1}, 4)
    take(mixture, 2)
    state = copy.deepcopy(mixture.get_state())
    for source in state["sources"].values():  # as saved by a data.workers=2 run
        source["position"] = {"workers": 2, "batches": {}}
    state["row"] = 1000
    before = mixture.get_state()
    with pytest.raises(DataError, match="saved with data.workers=2 "):
        mixture.set_state(state)
    assert mixture.get_state() == before


def test_the_trainer_refuses_with_exit_2_and_keeps_the_checkpoint(corpus, tmp_path, repo_root):
    workdir = tmp_path / "run"
    args = [f"data.path={corpus}", "checkpoint.every=2", "eval.every=100", "log.tensorboard=false"]
    args += [SHARED_SCHEDULE]
    tiny_in_process([*args, "run.steps=2"], workdir)  # the checkpoint; it ends without an error
    config = (workdir / "config.yaml").read_text()
    resumed = subprocess.run(
        tiny_cli([*args, "run.steps=4", "data.workers=2"], workdir),
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 2, resumed.stderr[-2000:]
    assert "Traceback" not in resumed.stderr
    assert "saved with data.workers=0 and does not carry over to data.workers=2" in resumed.stderr
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]  # not damaged
    assert (workdir / "config.yaml").read_text() == config
