"""A resume whose saved data position does not fit today's pipeline: one line, exit 2, naming the
checkpoint's step folder, what differs, and the way out; or, where the position carries over,
a resume that goes on from it.

Before: another `data.read_threads` over shuffled TFRecord data (another interleave cycle), or a
hand-garbled position file, ended in Grain's IndexError/KeyError/AttributeError tracebacks, and a
`null` one restarted the data from its first batch; another `data.shuffle`, `run.seed`,
`data.concat_offset`, a first_fit `data.seq_len` or `data.global_batch_size`, or a mixture's
`data.seq_len`, resumed in silence from a position that points elsewhere in the data; a mixture
resumed with a smaller `data.global_batch_size` ended in an IndexError. A value garbled inside
the right layout (a negative count, an index past its list) ended in a traceback from Grain or the
packer, or resumed elsewhere in silence; now one line says the position file is damaged.
"""

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SHARED_SCHEDULE, TINY, same, take, tiny_cli, tiny_in_process
from test_checkpoint import tfrecord_corpus  # noqa: F401 (a fixture)
from test_mixture import mixture, prose  # noqa: F401 (prose: a fixture)

from input_pipeline.checkpointing import resume_position
from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.mixture import MixedStream, rows_per_read
from input_pipeline.pipeline import make_batch_iterator
from input_pipeline.positions import DamagedPositionError, position_damage
from trainer.config import load_config
from trainer.data import dataset_sources
from trainer.train import run

# SHARED_SCHEDULE: every session, whatever its run.steps, shares a compiled step with the others
SESSION = ["checkpoint.every=2", "eval.every=100", "log.tensorboard=false", "log.every=1"]
SESSION += [SHARED_SCHEDULE]


def config(workdir, steps, *settings):
    return load_config(
        None, [*TINY, *SESSION, f"run.workdir={workdir}", f"run.steps={steps}", *settings]
    )


def cli(workdir, steps, *settings, repo_root):
    return subprocess.run(
        tiny_cli([*SESSION, f"run.steps={steps}", *settings], workdir),
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )


def refused(done: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a run that ended as a user error: exit 2, no traceback."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def test_a_position_grain_cannot_take_is_one_line_naming_the_step_and_setting(
    tfrecord_corpus,  # noqa: F811
    tmp_path,
    repo_root,
):
    """Shuffled TFRecord data interleaves data.read_threads shards: another count is another
    interleave, whose position Grain failed on with an IndexError traceback."""
    workdir = tmp_path / "run"
    data = [f"data.path={tfrecord_corpus}", "data.read_threads=4"]
    tiny_in_process([*SESSION, "run.steps=2", *data], workdir)  # ends without an error
    line = refused(cli(workdir, 4, *data, "data.read_threads=1", repo_root=repo_root))
    assert line.startswith(f"error: checkpoint {workdir / 'checkpoints' / '2'} "), line
    assert "(saved with data.read_threads=4, now 1)" in line
    assert "does not fit this run's data pipeline" in line
    assert "checkpoint.init_from" in line
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]  # kept


@pytest.fixture(scope="module")
def saved_run(corpus, tmp_path_factory):
    """A run of 2 steps on `corpus`: its workdir, to copy for each resume."""
    workdir = tmp_path_factory.mktemp("saved") / "run"
    run(config(workdir, 2, f"data.path={corpus}"))
    return workdir


def position_file(workdir):
    (path,) = (workdir / "checkpoints" / "2" / "data").glob("*.json")
    return path


GARBLED = {
    "null": lambda position: None,  # was: a silent start from the first batch
    "a list": lambda position: [1, 2, 3],  # was: AttributeError in the layout check
    "an empty mapping": lambda position: {},  # was: KeyError 'parent' in the packer
    "a stream count as text": lambda position: {**position, "streams": "1"},
    "a null stream position": lambda position: {**position, "positions": {"0": None}},
    "batches of other keys": lambda position: {
        **position,
        "positions": {"0": {**position["positions"]["0"], "batches": {"next": 3}}},
    },
    "a read index as text": lambda position: json.loads(
        json.dumps(position).replace('"next_index": 0', '"next_index": "0"')
    ),
}


@pytest.mark.parametrize("garble", GARBLED)
def test_a_garbled_position_file_is_one_line(saved_run, corpus, tmp_path, garble):
    workdir = tmp_path / "run"
    shutil.copytree(saved_run, workdir)
    path = position_file(workdir)
    path.write_text(json.dumps(GARBLED[garble](json.loads(path.read_text()))))
    with pytest.raises(DataError) as error:
        run(config(workdir, 4, f"data.path={corpus}"))
    line = str(error.value)
    assert line.startswith(f"checkpoint {workdir / 'checkpoints' / '2'}: "), line
    assert "does not fit this run's data pipeline" in line and "\n" not in line


def test_the_cli_refuses_a_garbled_position_with_exit_2(saved_run, corpus, tmp_path, repo_root):
    workdir = tmp_path / "run"
    shutil.copytree(saved_run, workdir)
    path = position_file(workdir)
    path.write_text("[1, 2, 3]")
    line = refused(cli(workdir, 4, f"data.path={corpus}", repo_root=repo_root))
    assert "(position is a list, not a mapping)" in line
    assert path.read_text() == "[1, 2, 3]"  # the checkpoint is left as it is


def test_garbled_positions_of_another_process_count_are_one_line(saved_run, corpus, tmp_path):
    """Positions of 2 processes, resumed on 1, are merged stream by stream (before: an
    AttributeError traceback from the merge when one held a list of positions)."""
    workdir = tmp_path / "run"
    shutil.copytree(saved_run, workdir)
    path = position_file(workdir)
    position = json.loads(path.read_text())
    path.unlink()
    for process, positions in enumerate([position["positions"], list(position["positions"])]):
        other = path.with_name(f"process_{process}-of-2.json")
        other.write_text(json.dumps({"streams": 2, "positions": positions}))
    with pytest.raises(DataError) as error:
        run(config(workdir, 4, f"data.path={corpus}"))
    line = str(error.value)
    assert line.startswith(f"checkpoint {workdir / 'checkpoints' / '2'}: "), line
    assert "(position.positions is a list, not a mapping)" in line


# (setting of the first session, of the second, the line's "saved with" part); each resumed in
# silence before, from a position that points elsewhere in the data
MOVED = [
    ("data.shuffle=true", "data.shuffle=false", "data.shuffle=true"),
    ("run.seed=0", "run.seed=1", "run.seed=0"),
    ("data.concat_offset=none", "data.concat_offset=random_per_epoch", "data.concat_offset=none"),
    ("data.packing=first_fit", "data.seq_len=32", "data.seq_len=64"),
    ("data.packing=first_fit", "data.global_batch_size=8", "data.global_batch_size=16"),
]


@pytest.mark.parametrize(("first", "second", "saved"), MOVED)
def test_a_setting_that_moves_the_position_is_refused(corpus, tmp_path, first, second, saved):
    workdir = tmp_path / "run"
    run(config(workdir, 2, f"data.path={corpus}", first))
    with pytest.raises(DataError) as error:
        run(config(workdir, 4, f"data.path={corpus}", first, second))
    line = str(error.value)
    assert line.startswith(f"checkpoint {workdir / 'checkpoints' / '2'}: "), line
    assert f"saved with {saved} and does not carry over to {second}" in line
    assert f"; set {saved} to resume this run, or start a new run.workdir" in line


def test_a_mixture_refuses_another_seq_len(corpus, prose, tmp_path):  # noqa: F811
    """A mixture's position holds each source's batch in hand and its used rows: at another
    row length those rows are others (before: a silent resume, up to a batch of rows off)."""
    workdir = tmp_path / "run"
    run(config(workdir, 2, mixture(corpus, prose)))
    with pytest.raises(DataError, match=r"saved with data.seq_len=64 and does not carry over to"):
        run(config(workdir, 4, mixture(corpus, prose), "data.seq_len=32"))


@pytest.mark.parametrize("change", ["data.seq_len=32", "data.global_batch_size=8"])
def test_concat_packing_of_one_dataset_carries_its_position_over(
    saved_run, corpus, tmp_path, change
):
    """The position is a token of the record stream: rows of another length or count go on from
    it."""
    workdir = tmp_path / "run"
    shutil.copytree(saved_run, workdir)
    result = run(config(workdir, 4, f"data.path={corpus}", change))
    assert result.step == 4


def mixed_stream(infos, weights, rows):
    """A `MixedStream` of `rows` rows per batch, each source batching its share of them."""
    iterators = {
        name: make_batch_iterator(
            info, "train", seq_len=64, batch_size=rows_per_read(weights[name], rows)
        )
        for name, info in infos.items()
    }
    return MixedStream(iterators, weights, rows)


def test_a_mixture_goes_on_with_the_same_rows_in_smaller_batches(corpus, prose):  # noqa: F811
    """Each source's batch in hand is re-read on resume and its used rows skipped: with a
    smaller data.global_batch_size they reach past the batch (before: an IndexError)."""
    infos = {"code": load_dataset_info(corpus), "prose": load_dataset_info(prose)}
    weights = {"code": 0.75, "prose": 0.25}
    big = mixed_stream(infos, weights, 16)
    take(big, 1)
    position = copy.deepcopy(big.get_state())
    assert position["sources"]["code"]["used"] == 12
    after = next(big)
    small = mixed_stream(infos, weights, 8)  # batches of 6 code rows: 12 used reach past one
    small.set_state(copy.deepcopy(position))
    halves = take(small, 2)
    assert same({k: v[:8] for k, v in after.items()}, halves[0])
    assert same({k: v[8:] for k, v in after.items()}, halves[1])


def test_a_mixture_resumes_with_a_smaller_batch_size(corpus, prose, tmp_path, repo_root):  # noqa: F811
    workdir = tmp_path / "run"
    tiny_in_process([*SESSION, "run.steps=2", mixture(corpus, prose)], workdir)  # no error
    second = cli(
        workdir, 4, mixture(corpus, prose), "data.global_batch_size=8", repo_root=repo_root
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert "finished at step 4" in second.stderr


# A value garbled inside the right layout. Before: Grain's or the packer's traceback (IndexError,
# ValueError, TypeError), or a silent resume from elsewhere in the data. Now: one line saying the
# position file is damaged, naming the value and the ways out.
def stream_iterator(*settings):
    """A fresh train `StreamBatches` of the TINY config with `settings`, as a resume builds it."""
    data = load_config(None, [*TINY, *settings])
    return dataset_sources(data.data, seed=data.run.seed).train


def position_after(batches, *settings):
    """The train data position of a pipeline with `settings` after `batches` batches."""
    iterator = stream_iterator(*settings)
    try:
        take(iterator, batches)
        return copy.deepcopy(iterator.get_state())
    finally:
        iterator.close_readers()


def with_value(position, path, value):
    """`position` with the leaf at `path` (keys and list indices) set to `value`."""
    position = copy.deepcopy(position)
    node = position["positions"]["0"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return position


def refusal(iterator, position, step_folder):
    """`resume_position`'s line refusing `position`, or None where `iterator` resumed from it."""
    try:
        resume_position(iterator, position, step_folder, None, {})
    except DataError as err:
        return str(err)
    return None


def resumed(position, *settings, step_folder):
    """Resume a fresh pipeline with `settings` from `position`; the refusal's line, or None."""
    iterator = stream_iterator(*settings)
    try:
        return refusal(iterator, position, step_folder)
    finally:
        iterator.close_readers()


def variants(corpus, tfrecord_corpus, prose):  # noqa: F811
    """Each pipeline variant's settings, by name."""
    return {
        "concat": [f"data.path={corpus}"],
        "first_fit": [f"data.path={corpus}", "data.packing=first_fit"],
        "tfrecord": [f"data.path={tfrecord_corpus}", "data.read_threads=4"],
        "tfdata": [f"data.path={tfrecord_corpus}", "data.reader=tfdata"],
        "workers": [f"data.path={corpus}", "data.workers=2"],
        "mixture": [mixture(corpus, prose)],
    }


BATCHES = ("batches",)
INTERLEAVE = (*BATCHES, "parent", "parent_window_start_state")
SOURCE = ("sources", "code", "position", *BATCHES)  # a mixture: its source code's packer
# (variant, path in stream 0's position, value, the field the line names); what each did before
DAMAGED = [
    ("concat", (*BATCHES, "parent", "next_index"), -1, "batches.parent.next_index"),  # IndexError
    ("concat", (*BATCHES, "offset"), -1, "batches.offset"),  # ValueError in the packer
    ("concat", (*BATCHES, "record"), -2, "batches.record"),  # silent: from the read's start
    ("concat", (*BATCHES, "record"), 10**9, "the concat packer's record"),  # silent: a read skipped
    ("concat", (*BATCHES, "offset"), 10**9, "the concat packer's offset"),  # silent: rest skipped
    ("first_fit", (*BATCHES, "counter"), -1, "batches.counter"),  # ValueError inside Grain
    ("first_fit", (*BATCHES, "next_row"), -1, "batches.next_row"),  # silent
    ("first_fit", (*BATCHES, "next_row"), 10**9, "batches.next_row"),  # ValueError in Grain
    ("tfrecord", (*INTERLEAVE, "iterators_in_use_states", 0, "reader_offset"), -1, "reader_offset"),
    ("tfrecord", (*INTERLEAVE, "iterators_in_use_indices", 1), 10**9, "use_indices[1]"),
    ("tfrecord", (*INTERLEAVE, "next_index_in_cycle"), 9, "next_index_in_cycle"),  # IndexError
    ("tfrecord", (*BATCHES, "parent", "window_index"), -1, "window_index"),  # TypeError
    ("workers", (*BATCHES, "next_index_in_cycle"), 5, "batches.next_index_in_cycle"),
    ("workers", (*BATCHES, "exhausted", 0), 7, "batches.exhausted[0]"),
    ("workers", (*BATCHES, "next_index_in_datasets"), 3, "batches.next_index_in_datasets"),
    ("mixture", ("taken", "code"), -1, "taken.code"),  # silent
    ("mixture", ("tokens", "prose"), float("nan"), "tokens.prose"),  # silent
    ("mixture", (*SOURCE, "record"), 10**9, "the concat packer's record"),  # silent
    ("mixture", (*SOURCE, "offset"), 10**9, "the concat packer's offset"),  # silent
    # Before: each re-read up to the saved count (hours: a restore walked 10**9 records)
    ("tfdata", (*BATCHES, "parent", "records_after"), 10**9, "records_after"),
    # Past a bound only the pipeline knows. Before: silent (the rest of the shard or window
    # skipped), an IndexError from Grain (a read past any dataset), or a silent mixture
    ("tfrecord", (*INTERLEAVE, "iterators_in_use_states", 0, "reader_offset"), 10**9, "offset"),
    ("tfrecord", (*BATCHES, "parent", "pos_in_window"), 1025, "batches.parent.pos_in_window"),
    ("concat", (*BATCHES, "parent", "next_index"), 2**63, "batches.parent.next_index"),
    ("mixture", ("row",), 10**9, "row"),
]


@pytest.fixture(scope="module")
def saved_positions():
    """Each variant's position after 3 batches, made once (a pipeline started per variant)."""
    return {}


@pytest.mark.parametrize(("variant", "path", "value", "field"), DAMAGED)
def test_a_value_no_run_writes_is_one_line_naming_the_file_and_field(
    corpus,
    tfrecord_corpus,  # noqa: F811
    prose,  # noqa: F811
    saved_positions,
    tmp_path,
    variant,
    path,
    value,
    field,
):
    settings = variants(corpus, tfrecord_corpus, prose)[variant]
    if variant not in saved_positions:
        saved_positions[variant] = position_after(3, *settings)
    position = with_value(saved_positions[variant], path, value)
    step_folder = tmp_path / "checkpoints" / "2"
    line = resumed(position, *settings, step_folder=step_folder)
    assert line is not None and "\n" not in line
    assert line.startswith(f"checkpoint {step_folder}: its data position file data/ is damaged ")
    assert f"(position.positions.0.{field}" in line or f"{field} " in line, line
    assert "rename 2 to 2.damaged to resume from the checkpoint before it" in line
    assert line.endswith(
        "start a new run.workdir whose checkpoint.init_from is this one (it keeps the weights)"
    )


WORKER = (*BATCHES, "iterators_in_use_states", 0)  # data.workers: worker 0's packer


@pytest.mark.parametrize("field", ["record", "offset"])
def test_a_worker_says_its_damaged_packer_position_at_its_first_batch(corpus, field):
    """Grain's workers set their packers' positions once they start, so a record or offset past
    its read is not seen by the resume: the damaged worker's first batch raises, naming the value
    (before: that worker moved on to the next record or read in silence)."""
    settings = [f"data.path={corpus}", "data.workers=2"]
    position = with_value(position_after(3, *settings), (*WORKER, field), 10**9)
    iterator = stream_iterator(*settings)
    try:
        assert refusal(iterator, position, Path("2")) is None
        damage = f"the concat packer's {field} is {10**9}"
        with pytest.raises(DamagedPositionError, match=damage):
            take(iterator, 4)  # every worker's batch
    finally:
        iterator.close_readers()


def test_a_stream_the_position_does_not_have_is_damage(saved_run, corpus, tmp_path):
    """Before: a position of stream 5 in a run of 1 stream was ignored in silence."""
    workdir = tmp_path / "run"
    shutil.copytree(saved_run, workdir)
    path = position_file(workdir)
    position = json.loads(path.read_text())
    position["positions"]["5"] = position["positions"]["0"]
    path.write_text(json.dumps(position))
    with pytest.raises(DataError) as error:
        run(config(workdir, 4, f"data.path={corpus}"))
    line = str(error.value)
    step = workdir / "checkpoints" / "2"
    assert line.startswith(
        f"checkpoint {step}: its data position file data/{path.name} is damaged (position."
        "positions has a stream '5', not one of 0..0); rename 2 to 2.damaged"
    ), line


def test_the_cli_refuses_a_damaged_value_with_exit_2(saved_run, corpus, tmp_path, repo_root):
    """Before: a ValueError traceback from the packer, exit 1."""
    workdir = tmp_path / "run"
    shutil.copytree(saved_run, workdir)
    path = position_file(workdir)
    position = json.loads(path.read_text())
    path.write_text(json.dumps(with_value(position, (*BATCHES, "offset"), -1)))
    line = refused(cli(workdir, 4, f"data.path={corpus}", repo_root=repo_root))
    assert f"data position file data/{path.name} is damaged" in line
    assert "(position.positions.0.batches.offset is -1, not a count of 0 or more)" in line
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]  # kept


@pytest.mark.parametrize("variant", ["concat", "first_fit", "tfrecord", "workers", "mixture"])
def test_real_positions_are_not_called_damaged(corpus, tfrecord_corpus, prose, variant):  # noqa: F811
    """Positions after 1 to 600 batches (past an epoch of the TFRecord corpus and the mixture's
    prose) resume as saved, and go on with the batches that followed them."""
    settings = variants(corpus, tfrecord_corpus, prose)[variant]
    iterator = stream_iterator(*settings)
    try:
        done = 0
        for batches in (1, 40, 600):
            take(iterator, batches - done)
            done = batches
            position = copy.deepcopy(iterator.get_state())
            assert position_damage(position) is None
            again = stream_iterator(*settings)
            try:
                assert refusal(again, position, Path("2")) is None
                assert same(next(again), next(iterator))
                done += 1
            finally:
                again.close_readers()
    finally:
        iterator.close_readers()
