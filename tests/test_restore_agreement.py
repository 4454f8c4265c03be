"""A checkpoint folder that cannot be listed ends the run with one line on every process: the
process that could not list it names the read error, the others name that process (before, they
waited in their next collective until JAX's coordination service aborted them). A listing that
fails only once Orbax lists the folder itself is the same line, without a traceback from Orbax's
cleanup thread. A data position file that one process refuses stops every process the same way,
and a resume agrees on its newest step in one all-gather."""

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import (
    SHARED_SCHEDULE,
    TINY,
    error_lines_of_a_user_error,
    preloadable_library,
    tiny_cli,
)
from test_multihost import on_two_joined_processes, run_args

from trainer.checkpoint import checkpointer as checkpointer_module
from trainer.config import load_config
from trainer.train import run

# A read error of the storage while listing a folder, made real: a preloaded library fails the
# opendir calls of $FAIL_LISTING_OF with $FAIL_LISTING_ERRNO, from the $FAIL_LISTING_FROM-th
# (default: the first) on, and only in the process whose $JAX_PROCESS_ID is
# $FAIL_LISTING_ON_PROCESS when that is set: one host whose NFS mount fails (EIO, ESTALE).
FAILING_LISTING = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

static const char *setting(const char *name, const char *otherwise) {
    const char *value = getenv(name);
    return value ? value : otherwise;
}

static int on_this_process(void) {
    const char *only = getenv("FAIL_LISTING_ON_PROCESS");
    return !only || strcmp(only, setting("JAX_PROCESS_ID", "")) == 0;
}

DIR *opendir(const char *path) {
    static DIR *(*real)(const char *);
    static int listings;
    const char *folder = getenv("FAIL_LISTING_OF");
    if (!real) real = dlsym(RTLD_NEXT, "opendir");
    if (folder && path && strcmp(path, folder) == 0 && on_this_process()
        && __atomic_add_fetch(&listings, 1, __ATOMIC_SEQ_CST)
               >= atoi(setting("FAIL_LISTING_FROM", "1"))) {
        errno = atoi(setting("FAIL_LISTING_ERRNO", "5"));
        return NULL;
    }
    return real(path);
}
"""

READ_ERROR_LINE = (
    "error: cannot read checkpoint folder {folder} ({problem}); nothing in it was changed: check "
    "the storage it is on (its mount, its permissions) and re-run"
)
# What the other processes say when `process` stopped on its own line about the folder.
STOPPED_BY_LINE = (
    "error: process {process} cannot {doing} checkpoint folder {folder} (its own log says why); "
    "nothing in it was changed: check the storage it is on from that host (its mount, its "
    "permissions) and re-run"
)


@pytest.fixture(scope="module")
def failing_listing(tmp_path_factory) -> Path:
    return preloadable_library(tmp_path_factory, "failing_listing_on_one", FAILING_LISTING)


def failing_listing_env(library: Path, folder: Path, **settings: str) -> dict[str, str]:
    """The environment that preloads `library` to fail listings of `folder` as `settings` say."""
    return {"LD_PRELOAD": str(library), "FAIL_LISTING_OF": str(folder), **settings}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("failing_from", "doing"),
    [("1", "read"), ("2", "open")],
    ids=["at_the_first_look", "once_orbax_lists_it"],
)
def test_a_checkpoint_folder_one_process_cannot_list_stops_every_process_in_one_line(
    corpus, tmp_path, repo_root, failing_listing, monkeypatch, failing_from, doing
):
    """Two processes start a run whose checkpoint folder process 1 alone cannot list (from our
    first look at it, or from Orbax's listing on): each ends at once with exit 2 and one line.
    Before, process 1 said why and exited while process 0 went on to its next collective (Orbax's
    barrier, or the restore's), where it failed with a traceback and JAX's coordination service
    aborted it."""
    workdir = tmp_path / "run"
    folder = workdir / "checkpoints"
    folder.mkdir(parents=True)
    settings = failing_listing_env(
        failing_listing, folder, FAIL_LISTING_ON_PROCESS="1", FAIL_LISTING_FROM=failing_from
    )
    for name, value in {**settings, "FAIL_LISTING_ERRNO": str(errno.EIO)}.items():
        monkeypatch.setenv(name, value)  # the processes' environment starts from this one's
    cli = ["-m", "trainer.main", "--config", "configs/tiny.yaml", *run_args(corpus, workdir)]
    statuses, printed = on_two_joined_processes(repo_root, [cli, cli], devices=4)
    said = [[line for line in out.splitlines() if "error:" in line] for out in printed]
    assert said == [
        [STOPPED_BY_LINE.format(process=1, doing=doing, folder=folder)],
        [READ_ERROR_LINE.format(folder=folder, problem="Input/output error [EIO]")],
    ], printed
    assert statuses == [2, 2], printed
    assert not any("Traceback" in out for out in printed), printed
    assert list(folder.iterdir()) == []


@pytest.mark.slow
def test_a_listing_that_fails_once_orbax_lists_the_folder_is_the_same_one_line(
    corpus, tmp_path, repo_root, failing_listing
):
    """The folder lists at the first look, then fails (an NFS mount going away during
    start-up): Orbax's own listings fail. Before: "cannot create checkpoint folder ...; choose a
    writable run.workdir" (the wrong words), and a traceback from Orbax's cleanup thread at
    exit."""
    workdir = tmp_path / "run"
    folder = workdir / "checkpoints"
    folder.mkdir(parents=True)
    settings = failing_listing_env(
        failing_listing, folder, FAIL_LISTING_FROM="2", FAIL_LISTING_ERRNO=str(errno.ESTALE)
    )
    done = subprocess.run(
        tiny_cli([*TINY, f"data.path={corpus}", "run.steps=2", "checkpoint.every=2"], workdir),
        cwd=repo_root,
        env={**os.environ, **settings},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert error_lines_of_a_user_error(done) == [
        READ_ERROR_LINE.format(folder=folder, problem="Stale file handle [ESTALE]")
    ], done.stderr[-3000:]
    assert list(folder.iterdir()) == []


# What a process left waiting in a collective prints when JAX's coordination service aborts it.
JAX_ABORTED = ("Traceback", "Check failure")


def damage_an_offset(position: object) -> bool:
    """Set the first `offset` count in a data position to -1 (a value no run writes)."""
    if isinstance(position, dict):
        if isinstance(position.get("offset"), int):
            position["offset"] = -1
            return True
        return any(damage_an_offset(value) for value in position.values())
    if isinstance(position, list):
        return any(damage_an_offset(value) for value in position)
    return False


@pytest.mark.slow
def test_a_data_position_one_process_refuses_stops_every_process_in_one_line(
    corpus, tmp_path, repo_root
):
    """Each process reads its own data position file; process 1's is damaged, process 0's is
    whole. Before: process 1 said why and exited while process 0 resumed into its first step's
    collectives, where JAX's coordination service aborted it (or the test's wait ran out)."""
    workdir = tmp_path / "run"

    def cli(steps: int) -> list[str]:
        settings = run_args(corpus, workdir, f"run.steps={steps}", "checkpoint.every=2")
        return ["-m", "trainer.main", "--config", "configs/tiny.yaml", *settings]

    statuses, printed = on_two_joined_processes(repo_root, [cli(2), cli(2)], devices=4)
    assert statuses == [0, 0], printed
    step = workdir / "checkpoints" / "2"
    path = step / "data" / "process_1-of-2.json"
    position = json.loads(path.read_text())
    assert damage_an_offset(position), position
    path.write_text(json.dumps(position))
    statuses, printed = on_two_joined_processes(repo_root, [cli(4), cli(4)], devices=4)
    said = [[line for line in out.splitlines() if "error:" in line] for out in printed]
    assert said[0] == [
        f"error: process 1 refused its data position in checkpoint {step} (its own line says why "
        "and what to do); nothing in it was changed"
    ], printed
    assert len(said[1]) == 1, printed
    assert said[1][0].startswith(
        f"error: checkpoint {step}: its data position file data/{path.name} is damaged ("
    ), printed
    assert "is -1, not a count of 0 or more" in said[1][0], printed
    assert statuses == [2, 2], printed
    assert not any(text in out for out in printed for text in JAX_ABORTED), printed
    assert sorted(p.name for p in step.parent.iterdir()) == ["2"]


def test_a_resume_agrees_on_its_newest_step_in_one_all_gather(corpus, tmp_path, monkeypatch):
    """Before: the newest step was all-gathered to choose between a restore and a fresh start,
    then again by the restore itself. (The step is the first value of its gather's row.)"""
    gathered, real = [], checkpointer_module.gather_rows

    def counted(mine):
        gathered.append(mine.ravel()[0])
        return real(mine)

    def session(steps: int) -> None:
        settings = [f"data.path={corpus}", f"run.workdir={tmp_path}", f"run.steps={steps}"]
        settings += [SHARED_SCHEDULE, "checkpoint.every=2", "log.tensorboard=false"]
        run(load_config(None, [*TINY, *settings]))

    session(2)
    monkeypatch.setattr(checkpointer_module, "gather_rows", counted)
    session(4)
    assert gathered.count(2) == 1, gathered
