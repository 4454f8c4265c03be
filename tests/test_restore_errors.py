"""Several processes restoring one checkpoint agree on what to do with it: a damage only one of
them reads moves it aside for all (each then falls back to the same older step), and a failure
that shows no damage on any one of them (a read error of its NFS mount) stops every process with
the checkpoint left in place. A resume reads the checkpoint's metadata once, and a checkpoint
folder that cannot be listed is one line naming the read error."""

import errno
import os
import shutil
import subprocess
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
from conftest import (
    TINY,
    error_lines_of_a_user_error,
    preloadable_library,
    tiny_cli,
    tiny_run,
)
from test_multihost import on_two_joined_processes

from trainer.train import run

# Two processes save steps 1 and 2 of a replicated array, then restore the newest while the read
# of step 2's metadata fails on process 1 alone: with `failure` "eio" as an NFS read error does,
# with "damaged" as a file that does not parse. Each writes what it says to its own file
# (stdout also carries Gloo's lines, written in pieces).
RESTORE_WHILE_ONE_PROCESS_FAILS = """
import errno
import json
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import CheckpointConfig
from trainer.errors import TrainingError
from trainer.parallel.distributed import cluster_from_env, initialize
from trainer.parallel.state import TrainState

folder, failure, said = sys.argv[1:]
said = open(said, "w", buffering=1)
initialize(cluster_from_env())
replicated = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec())


def on_every_device(value):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, replicated, lambda index: value[index])


params = {"w": on_every_device(np.arange(64, dtype=np.float32))}
checkpointer = Checkpointer(folder, CheckpointConfig())
for step in (1, 2):
    state = TrainState(on_every_device(np.int32(step)), params, {}, {})
    checkpointer.save(step, state, None, {"param_shapes": param_shapes(params)})
checkpointer.close()

read_json = ocp.JsonCheckpointHandler.restore


def fails_on_process_1(handler, directory, *args, **kwargs):
    if jax.process_index() == 1 and Path(directory).parts[-2:] == ("2", "meta"):
        if failure == "eio":
            raise OSError(errno.EIO, "Input/output error")
        raise json.JSONDecodeError("Expecting value", "", 0)
    return read_json(handler, directory, *args, **kwargs)


ocp.JsonCheckpointHandler.restore = fails_on_process_1
checkpointer = Checkpointer(folder, CheckpointConfig())
target = {"w": jax.ShapeDtypeStruct((64,), np.float32, sharding=replicated)}
try:
    step, _ = checkpointer.restore_newest(lambda step: checkpointer.restore_params(step, target))
    print(f"restored step {step}", file=said)
except TrainingError as err:
    print(f"error: {err}", file=said)
checkpointer.close()
print("folders: " + " ".join(sorted(p.name for p in Path(folder).iterdir())), file=said)
"""


def restore_on_two_processes(tmp_path: Path, repo_root: Path, failure: str):
    """What each process said, and what each printed (process 0's warnings)."""
    script = tmp_path / "restore.py"
    script.write_text(RESTORE_WHILE_ONE_PROCESS_FAILS)
    folder = tmp_path / "checkpoints"
    said = [tmp_path / f"said{i}.txt" for i in range(2)]
    statuses, printed = on_two_joined_processes(
        repo_root, [[str(script), str(folder), failure, str(said[i])] for i in range(2)], devices=1
    )
    assert statuses == [0, 0], printed
    return [path.read_text().splitlines() for path in said], printed


@pytest.mark.slow
def test_a_read_error_on_one_process_stops_all_and_moves_nothing(tmp_path, repo_root):
    """Before, the EIO on process 1 was agreed to be damage: both moved step 2 aside and resumed
    from step 1."""
    said, printed = restore_on_two_processes(tmp_path, repo_root, "eio")
    newest = tmp_path / "checkpoints" / "2"
    kept = "it is left in place, as are the older ones"
    assert said[0] == [
        f"error: checkpoint {newest} did not restore on another process (its own line says "
        f"why); {kept}",
        "folders: 1 2",
    ], printed
    assert said[1] == [
        f"error: cannot read checkpoint {newest} (Input/output error [EIO]); {kept}: check the "
        "storage it is on and re-run, or rename it to 2.damaged to resume from the one before",
        "folders: 1 2",
    ], printed
    assert "does not restore" not in printed[0]


@pytest.mark.slow
def test_a_damage_only_one_process_reads_moves_it_aside_for_all(tmp_path, repo_root):
    said, printed = restore_on_two_processes(tmp_path, repo_root, "damaged")
    assert said == [["restored step 1", "folders: 1 2.damaged"]] * 2, printed
    assert (
        f"warning: checkpoint {tmp_path / 'checkpoints' / '2'} does not restore (it failed to "
        "restore on another process); moved it to 2.damaged; trying the previous one"
    ) in printed[0]


@pytest.fixture(scope="module")
def resumable(corpus, tmp_path_factory) -> Path:
    """A tiny run's workdir after 2 steps: one checkpoint, step 2, to resume from."""
    workdir = tmp_path_factory.mktemp("resumable") / "run"
    run(tiny_run(corpus, workdir, steps=2))
    return workdir


def failing_after_the_first_read(folder: Path, reads: list[Path]):
    """Orbax's JSON handler, recording each read of `folder` in `reads`: every read after the
    first fails with an NFS mount's EIO."""
    original = ocp.JsonCheckpointHandler.restore

    def restore(handler, directory, *args, **kwargs):
        if Path(directory) == folder:
            reads.append(folder)
            if len(reads) > 1:
                raise OSError(errno.EIO, "Input/output error")
        return original(handler, directory, *args, **kwargs)

    return restore


@pytest.mark.slow
def test_a_resume_reads_the_checkpoint_metadata_once(
    resumable, corpus, tmp_path, monkeypatch, capfd
):
    """The startup lines use the metadata the restore read. Before, they read it again after the
    restore, and a read error there was a raw OSError traceback."""
    workdir = tmp_path / "run"
    shutil.copytree(resumable, workdir)
    meta, reads = workdir / "checkpoints" / "2" / "meta", []
    monkeypatch.setattr(
        ocp.JsonCheckpointHandler, "restore", failing_after_the_first_read(meta, reads)
    )
    capfd.readouterr()
    run(tiny_run(corpus, workdir, steps=4))
    err = capfd.readouterr().err
    assert f"resuming from {workdir / 'checkpoints' / '2'} (step 2)" in err, err[-3000:]
    assert "does not restore" not in err
    assert reads == [meta]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]


# A read error of the storage while listing a folder, made real: a preloaded library fails each
# opendir of $FAIL_LISTING_OF with $FAIL_LISTING_ERRNO, as an NFS mount does after a server
# restart (ESTALE) or a network fault (EIO).
FAILING_LISTING = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

DIR *opendir(const char *path) {
    static DIR *(*real)(const char *);
    const char *folder = getenv("FAIL_LISTING_OF");
    if (!real) real = dlsym(RTLD_NEXT, "opendir");
    if (folder && path && strcmp(path, folder) == 0) {
        errno = atoi(getenv("FAIL_LISTING_ERRNO"));
        return NULL;
    }
    return real(path);
}
"""


@pytest.fixture(scope="module")
def failing_listing(tmp_path_factory) -> Path:
    return preloadable_library(tmp_path_factory, "failing_listing", FAILING_LISTING)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("code", "problem"),
    [
        (errno.EIO, "Input/output error [EIO]"),
        (errno.ESTALE, "Stale file handle [ESTALE]"),
        (errno.EACCES, "Permission denied [EACCES]"),
    ],
    ids=["eio", "estale", "eacces"],
)
def test_a_checkpoint_folder_that_cannot_be_listed_exits_2_with_one_line(
    resumable, corpus, tmp_path, repo_root, failing_listing, code, problem
):
    """Through the CLI, as a job meets a flaky NFS mount at start-up. Before: "cannot create
    checkpoint folder ...; choose a writable run.workdir" (the wrong words), and a traceback from
    Orbax's thread that was listing the folder too."""
    workdir = tmp_path / "run"
    shutil.copytree(resumable, workdir)
    folder = workdir / "checkpoints"
    done = subprocess.run(
        tiny_cli([*TINY, f"data.path={corpus}", "run.steps=4", "checkpoint.every=2"], workdir),
        cwd=repo_root,
        env={
            **os.environ,
            "LD_PRELOAD": str(failing_listing),
            "FAIL_LISTING_OF": str(folder),
            "FAIL_LISTING_ERRNO": str(code),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert error_lines_of_a_user_error(done) == [
        f"error: cannot read checkpoint folder {folder} ({problem}); nothing in it was changed: "
        "check the storage it is on (its mount, its permissions) and re-run"
    ], done.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == ["2"]
