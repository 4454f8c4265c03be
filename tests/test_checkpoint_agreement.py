"""Checkpoint decisions that each process takes on its own reading of the storage are agreed
before any of them acts on it: a process that raised alone, or skipped a step alone, while the
others went on to a collective, left them waiting there until JAX's coordination service
aborted them. Each case stops (or skips) on every process at once, with one line on each: the
process that met the problem says what it met, the others name that process."""

import pytest
from test_multihost import on_two_joined_processes
from test_restore_agreement import STOPPED_BY_LINE

# Two processes do `case` with `folder` and a replicated array (the `open_existing` cases save
# it as step 1 first) while one of them reads the storage otherwise (patched in that process: the
# decision under test is ours, not the storage's). Each writes what it says to its own file
# (stdout also carries Gloo's lines).
ON_TWO_PROCESSES = """
import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import CheckpointConfig
from trainer.errors import ConfigError, TrainingError
from trainer.parallel.distributed import cluster_from_env, initialize
from trainer.parallel.state import TrainState

case, folder, said = sys.argv[1:]
folder, said = Path(folder), open(said, "w", buffering=1)
initialize(cluster_from_env())
replicated = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec())
array = np.arange(64, dtype=np.float32)
params = {"w": jax.make_array_from_callback(array.shape, replicated, lambda index: array[index])}
step = jax.make_array_from_callback((), replicated, lambda index: np.int32(1))
state, meta = TrainState(step, params, {}, {}), {"param_shapes": param_shapes(params)}
here = jax.process_index()


def unseen_here(real):
    # A host whose mount lacks the past run's workdir: no folder under it is there.
    return lambda path: False if folder.parent in (path, *path.parents) else real(path)


def unlisted_here(real):
    # A listing of the checkpoint folder that lags: what was renamed in it is not there yet.
    return lambda path, *args, **kwargs: iter(()) if path == folder else real(path, *args, **kwargs)


def no_room_here(real, where):
    # A shared disk read a moment later than the other process did: full.
    empty = shutil._ntuple_diskusage(1 << 40, 1 << 40, 0)
    return lambda path: empty if Path(path) == where else real(path)


def refused_here(real, keyword=None):
    # A folder that one process alone fails to make or write in (a quota, a permission): the
    # path is the first argument, or the argument `keyword`.
    def refusing(*args, **kwargs):
        path = kwargs.get(keyword) if keyword else args[0]
        if path is not None and Path(path) == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(*args, **kwargs)

    return refusing


try:
    if case.startswith("open_existing"):
        checkpointer = Checkpointer(folder, CheckpointConfig())
        checkpointer.save(1, state, None, meta)
        checkpointer.close()
        if here == 1 and case == "open_existing":
            Path.is_dir = unseen_here(Path.is_dir)
        if here == 1 and case == "open_existing_listed_late":  # a listing not refreshed yet
            ocp.CheckpointManager.latest_step = lambda manager: None
        if here == 1 and case == "open_existing_step_listed_late":
            ocp.CheckpointManager.all_steps = lambda manager, read=False: []
        if case == "open_existing_step_listed_late":  # export and generate with --step 1
            Checkpointer.restore_past_run(folder.parent, 1, Checkpointer.read_meta, advice="")
        checkpointer, latest = Checkpointer.open_existing(folder.parent)
        checkpointer.close()
        print(f"found step {latest}", file=said)
    elif case == "warm_up":
        if here == 1:
            shutil.disk_usage = no_room_here(shutil.disk_usage, folder.parent)
        checkpointer = Checkpointer(folder, CheckpointConfig())
        checkpointer.warm_up(state, meta)
        print(f"warming up: {checkpointer._warming is not None}", file=said)
        checkpointer.save(1, state, None, meta)
        checkpointer.close()
        print("saved step 1", file=said)
    elif case == "save":
        checkpointer = Checkpointer(folder, CheckpointConfig())
        if here == 1:
            shutil.disk_usage = no_room_here(shutil.disk_usage, folder)
        try:
            checkpointer.save(1, state, None, meta)
        finally:
            checkpointer.close()
        print("saved step 1", file=said)
    elif case == "save_not_writable":
        checkpointer = Checkpointer(folder, CheckpointConfig())
        if here == 1:
            tempfile.TemporaryFile = refused_here(tempfile.TemporaryFile, keyword="dir")
        try:
            checkpointer.save(1, state, None, meta)
        finally:
            checkpointer.close()
        print("saved step 1", file=said)
    elif case == "restore_listed_late":  # a resume whose host lists the newest step late
        checkpointer = Checkpointer(folder, CheckpointConfig())
        for saved in (1, 2):
            checkpointer.save(saved, state, None, meta)
        checkpointer.close()
        if here == 1:
            ocp.CheckpointManager.all_steps = lambda manager, read=False: [1]
            ocp.CheckpointManager.latest_step = lambda manager: 1
        checkpointer = Checkpointer(folder, CheckpointConfig())
        try:
            newest = checkpointer.newest_step()
            read, _ = checkpointer.restore_newest(lambda step: checkpointer.read_meta(step))
            print(f"newest {newest}, read step {read}", file=said)
        finally:
            checkpointer.close()
    elif case == "init_from_hf":  # a Hugging Face folder that process 1's host lacks
        from types import SimpleNamespace

        from trainer.train import init_from

        def load_params(path, target):
            if here == 1:
                raise ConfigError(f"hf:{path} has no *.safetensors files; download the weights")
            return target

        program = SimpleNamespace(
            mesh=replicated.mesh, abstract_state=lambda: state, init=lambda: state
        )
        spec = SimpleNamespace(hf=SimpleNamespace(load_params=load_params))
        init_from(f"hf:{folder.parent / 'hf'}", program, spec)
        print("loaded", file=said)
    elif case == "create":
        if here == 0:
            os.mkdir = refused_here(os.mkdir)
        Checkpointer(folder, CheckpointConfig()).close()
        print("created", file=said)
    elif case == "fresh_start_damaged_listed_late":  # step 1 was set aside as damaged
        from types import SimpleNamespace

        from trainer.train import restore_or_init

        (folder / "1.damaged").mkdir(parents=True, exist_ok=True)
        if here == 1:  # its listing of the folder not refreshed yet since the rename
            Path.glob = unlisted_here(Path.glob)
        checkpointer = Checkpointer(folder, CheckpointConfig())
        config = SimpleNamespace(checkpoint=SimpleNamespace(init_from=""))
        program = SimpleNamespace(abstract_state=lambda: state, init=lambda: state)
        try:
            _, start, _ = restore_or_init(config, checkpointer, program, None, None)
            print(f"started afresh at step {start}", file=said)
        finally:
            checkpointer.close()
    elif case == "unexpected_errors":  # a bug on one process at each step that reads storage
        import traceback
        from types import SimpleNamespace

        from input_pipeline.errors import DataError
        from trainer.train import (
            hf_params_on_every_process,
            open_same_data,
            resume_position_on_every_process,
        )

        def outcome(call):
            try:
                call()
                return "went on"
            except (ConfigError, DataError, TrainingError) as err:
                return f"error: {err}"
            except Exception as err:  # its own, unchanged: raised where its last frame says
                raised_in = traceback.extract_tb(err.__traceback__)[-1].name
                return f"{type(err).__name__} from {raised_in}"

        def set_state(position):  # a Grain iterator's
            if here == 1:
                raise IndexError("list index out of range")

        def load_params(path, target):
            if here == 0:
                raise KeyError("model.embed.weight")
            return target

        def open_sources():
            if here == 1:
                raise AttributeError("'NoneType' object has no attribute 'shards'")

        def _check_writable(checkpointer, doing):  # once its manager is open (past Orbax's barrier)
            raise RuntimeError("a bug")

        if here == 0:
            Checkpointer._check_writable = _check_writable
        batches, config = SimpleNamespace(set_state=set_state), SimpleNamespace(to_dict=dict)
        calls = [
            lambda: resume_position_on_every_process(batches, {}, folder / "1", {}, config),
            lambda: hf_params_on_every_process("hf:w", "w", load_params, params, replicated.mesh),
            lambda: open_same_data(SimpleNamespace(mixture=None, path="w"), open_sources, True),
            lambda: Checkpointer(folder, CheckpointConfig()).close(),
        ]
        for call in calls:
            print(outcome(call), file=said)
except (ConfigError, TrainingError) as err:
    print(f"error: {err}", file=said)
print("folder: " + ("there" if folder.exists() else "absent"), file=said)
"""


def on_two_processes(tmp_path, repo_root, case: str) -> tuple[list[list[str]], list[str]]:
    """What each process said, and what each printed; both must have exited 0."""
    script = tmp_path / "agree.py"
    script.write_text(ON_TWO_PROCESSES)
    folder = tmp_path / "run" / "checkpoints"
    said = [tmp_path / f"said{i}.txt" for i in range(2)]
    statuses, printed = on_two_joined_processes(
        repo_root, [[str(script), case, str(folder), str(said[i])] for i in range(2)], devices=1
    )
    assert statuses == [0, 0], printed
    assert not any("Traceback" in out for out in printed), printed
    return [path.read_text().splitlines() for path in said], printed


@pytest.mark.slow
def test_a_past_run_one_process_does_not_see_stops_every_process_in_one_line(tmp_path, repo_root):
    """`open_existing` (init_from, export, generate). Before: process 1 raised "holds no
    checkpoints" alone while process 0 waited in the checkpointer's first all-gather."""
    said, printed = on_two_processes(tmp_path, repo_root, "open_existing")
    folder = tmp_path / "run" / "checkpoints"
    assert said == [
        [
            STOPPED_BY_LINE.format(process=1, doing="find", folder=folder),
            "folder: there",
        ],
        [
            f"error: {folder.parent} holds no checkpoints; give the run.workdir of a past run",
            "folder: there",
        ],
    ], printed


@pytest.mark.slow
def test_a_past_run_one_process_lists_no_checkpoint_of_stops_every_process_in_one_line(
    tmp_path, repo_root
):
    """The folder is there on every host, but one lists no complete step in it."""
    said, printed = on_two_processes(tmp_path, repo_root, "open_existing_listed_late")
    folder = tmp_path / "run" / "checkpoints"
    assert said == [
        [
            STOPPED_BY_LINE.format(process=1, doing="list a checkpoint in", folder=folder),
            "folder: there",
        ],
        [
            f"error: {folder} holds no complete checkpoint; give the run.workdir of a past run",
            "folder: there",
        ],
    ], printed


@pytest.mark.slow
def test_a_step_one_process_does_not_list_stops_every_process_in_one_line(tmp_path, repo_root):
    """Export and generate of a step asked for by number. Before: process 1 raised "has no
    step 1" alone while process 0 went on to read it, and waited at Orbax's restore barrier."""
    said, printed = on_two_processes(tmp_path, repo_root, "open_existing_step_listed_late")
    folder = tmp_path / "run" / "checkpoints"
    assert said == [
        [
            STOPPED_BY_LINE.format(process=1, doing="find step 1 in", folder=folder),
            "folder: there",
        ],
        [f"error: {folder} has no step 1; saved steps: []", "folder: there"],
    ], printed


@pytest.mark.slow
def test_a_warm_up_one_process_finds_no_room_for_is_skipped_on_every_process(tmp_path, repo_root):
    """Before: process 1 skipped the warm-up save and went on to the real one while process 0
    opened the warm-up folder, each in a collective the other never reached."""
    said, printed = on_two_processes(tmp_path, repo_root, "warm_up")
    assert said == [["warming up: False", "saved step 1", "folder: there"]] * 2, printed


@pytest.mark.slow
def test_a_save_one_process_finds_no_room_for_stops_every_process_in_one_line(tmp_path, repo_root):
    """Before: process 1 refused the save alone while process 0 started it, and waited at
    Orbax's first save barrier; then process 0's line said to check the mount and permissions
    of a disk that was full."""
    said, printed = on_two_processes(tmp_path, repo_root, "save")
    folder = tmp_path / "run" / "checkpoints"
    assert said == [
        [
            f"error: process 1 found no room for the save of step 1 in checkpoint folder {folder} "
            "(its own log says how much it needs); nothing in it was changed: free space there, "
            "lower checkpoint.keep, or point run.workdir at a larger disk",
            "folder: there",
        ],
        [
            f"error: checkpoint folder {folder} has 0.0 MB free but the save of step 1 needs "
            "about 0.0 MB; free space there, lower checkpoint.keep, or point run.workdir at a "
            "larger disk",
            "folder: there",
        ],
    ], printed


@pytest.mark.slow
def test_a_save_into_a_folder_one_process_cannot_write_stops_every_process_in_one_line(
    tmp_path, repo_root
):
    """The others' line fits the kind of problem: here the folder's permissions, not its space."""
    said, printed = on_two_processes(tmp_path, repo_root, "save_not_writable")
    folder = tmp_path / "run" / "checkpoints"
    assert said == [
        [
            STOPPED_BY_LINE.format(process=1, doing="save into", folder=folder),
            "folder: there",
        ],
        [
            f"error: checkpoint folder {folder} is not writable (Permission denied) while saving "
            "step 1; fix the permissions there, or point run.workdir elsewhere",
            "folder: there",
        ],
    ], printed


@pytest.mark.slow
def test_a_checkpoint_folder_process_0_cannot_make_stops_every_process_in_one_line(
    tmp_path, repo_root
):
    """Orbax makes the folder on process 0 alone, then waits at a barrier. Before: process 0
    raised from the failed mkdir into our next all-gather, and process 1 failed at Orbax's
    barrier with a traceback (its name did not match)."""
    said, printed = on_two_processes(tmp_path, repo_root, "create")
    folder = tmp_path / "run" / "checkpoints"
    assert said == [
        [
            f"error: cannot create checkpoint folder {folder}: Permission denied; choose a "
            "writable run.workdir",
            "folder: absent",
        ],
        [
            STOPPED_BY_LINE.format(process=0, doing="create", folder=folder),
            "folder: absent",
        ],
    ], printed


@pytest.mark.slow
def test_a_resume_whose_processes_list_other_newest_steps_stops_every_process_in_one_line(
    tmp_path, repo_root
):
    """A host whose listing of the shared folder lags. Before: process 0 restored step 2 and
    process 1 step 1, each its own shards of the model, in silence."""
    said, printed = on_two_processes(tmp_path, repo_root, "restore_listed_late")
    folder = tmp_path / "run" / "checkpoints"
    line = (
        f"error: the processes list other checkpoints in {folder} (the newest to read, process "
        "0: step 2, process 1: step 1): their hosts see the folder differently (a network "
        "filesystem's cache not yet refreshed, or another folder at that path); nothing was "
        "read or changed: re-run once every host lists the same steps"
    )
    assert said == [[line, "folder: there"]] * 2, printed


@pytest.mark.slow
def test_a_hugging_face_folder_one_process_cannot_read_stops_every_process_in_one_line(
    tmp_path, repo_root
):
    """`checkpoint.init_from=hf:PATH`. Before: process 1 raised alone while process 0 went on
    with the weights it read, into the first step's collectives."""
    said, printed = on_two_processes(tmp_path, repo_root, "init_from_hf")
    hf = tmp_path / "run" / "hf"
    assert said == [
        [
            f"error: process 1 cannot read checkpoint.init_from=hf:{hf} (its own line says why); "
            "every host must see the same folder at that path",
            "folder: absent",
        ],
        [f"error: hf:{hf} has no *.safetensors files; download the weights", "folder: absent"],
    ], printed


@pytest.mark.slow
def test_a_damaged_step_one_process_does_not_list_stops_every_process(tmp_path, repo_root):
    """No step listed, one set aside as damaged, which process 1's listing does not show yet.
    Before: process 0 stopped (a run never starts afresh over damaged checkpoints) while
    process 1 started afresh, each its own way."""
    said, printed = on_two_processes(tmp_path, repo_root, "fresh_start_damaged_listed_late")
    folder = tmp_path / "run" / "checkpoints"
    advice = (
        "start fresh with another run.workdir, or repair them (rename a repaired one back to its "
        "step number) and re-run"
    )
    assert said == [
        [
            f"error: no checkpoint in {folder} restores (damaged ones moved aside: 1.damaged); "
            + advice,
            "folder: there",
        ],
        [f"error: no checkpoint in {folder} restores; {advice}", "folder: there"],
    ], printed


def unexpected_on(process: int, doing: str) -> str:
    """What the other processes say when `process` met an error that is not a user's."""
    return (
        f"error: process {process} met an unexpected error while {doing} (its own log has the "
        "traceback, a bug to report); every process stopped with it"
    )


@pytest.mark.slow
def test_an_unexpected_error_on_one_process_stops_every_process(tmp_path, repo_root):
    """A bug (or a library's unexpected error, as Grain's IndexError) while one process puts
    back its data position, reads a Hugging Face folder, opens its data or its checkpoint
    folder: that one raises it unchanged (its traceback is the report), the others stop with a
    line naming it. Before: only a user's error was agreed; the one that met a bug stopped
    alone while the others went on to their next collective."""
    said, printed = on_two_processes(tmp_path, repo_root, "unexpected_errors")
    folder = tmp_path / "run" / "checkpoints"
    assert said == [
        [
            unexpected_on(1, f"putting back its data position from checkpoint {folder / '1'}"),
            "KeyError from load_params",
            unexpected_on(1, "opening its data at data.path=w"),
            "RuntimeError from _check_writable",
            "folder: there",
        ],
        [
            "IndexError from set_state",
            unexpected_on(0, "reading checkpoint.init_from=hf:w"),
            "AttributeError from open_sources",
            unexpected_on(0, f"opening checkpoint folder {folder}"),
            "folder: there",
        ],
    ], printed
