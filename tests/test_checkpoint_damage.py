"""Damaged checkpoints never stop a run that has an intact one: the damaged step folder is named
in one warning line and moved aside (never deleted), and the run resumes from the newest
checkpoint that restores completely, with the same losses as an undamaged run. With none left,
the run exits 2 with one line. Export, `trainer.generate` and `checkpoint.init_from` fall back the
same way, and a failed restore leaves no read behind to print a traceback at exit. Only damage
moves a checkpoint: a read error of the storage, memory, an interrupt or a bug leaves them all in
place."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import SHARED_SCHEDULE, TINY, error_lines_of_a_user_error, preloadable_library

from trainer.config import load_config
from trainer.errors import ConfigError, TrainingError
from trainer.export import export_params
from trainer.generate import load_generator
from trainer.models import builder_for_vocab, model_spec
from trainer.parallel import sharding
from trainer.preemption import Stopped
from trainer.program import build_program
from trainer.train import init_from, run

STEPS = 6
ARGS = [
    *TINY,
    f"run.steps={STEPS}",
    SHARED_SCHEDULE,
    "checkpoint.every=2",  # checkpoints 2, 4, 6
    "checkpoint.keep=10",
    "eval.every=100",
    "log.tensorboard=false",
]


def rows_of(workdir: Path) -> list[dict]:
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def losses_of(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows_of(workdir) if "loss" in r}


def truncate_a_file(step: Path, item: str = "train") -> None:
    biggest = max((p for p in (step / item).rglob("*") if p.is_file()), key=_size)
    with biggest.open("r+b") as f:
        f.truncate(_size(biggest) // 2)


def delete_the_train_item(step: Path) -> None:
    shutil.rmtree(step / "train")


def corrupt_the_metadata_json(step: Path) -> None:
    (step / "meta" / "metadata").write_text('{"config": {"run": ')


def empty_the_folder(step: Path) -> None:
    shutil.rmtree(step)
    step.mkdir()


def write_a_list_for_the_metadata(step: Path) -> None:
    # Valid JSON, but not the object every save writes.
    (step / "meta" / "metadata").write_text("[1, 2]")


def drop_the_parameter_shapes(step: Path) -> None:
    # Valid JSON that lacks what every save writes: damaged, not "from another model".
    meta = json.loads((step / "meta" / "metadata").read_text())
    del meta["param_shapes"]
    (step / "meta" / "metadata").write_text(json.dumps(meta))


def train_tree_file(step: Path) -> Path:
    """The train item's tree (Orbax's `_METADATA`): without it the item restores no tuple."""
    return step / "train" / "_METADATA"


def delete_the_train_tree(step: Path) -> None:
    train_tree_file(step).unlink()


def empty_the_train_tree(step: Path) -> None:
    train_tree_file(step).write_text("")


def cut_the_train_tree(step: Path) -> None:
    text = train_tree_file(step).read_text()
    train_tree_file(step).write_text(text[: len(text) // 2])


def write_no_tree_for_the_train_item(step: Path) -> None:
    train_tree_file(step).write_text("{}")


def write_another_tree_for_the_train_item(step: Path) -> None:
    # Valid JSON of a tree, but not this step's: the optimizer state's last entry left out.
    tree = json.loads(train_tree_file(step).read_text())
    entries = tree["tree_metadata"]
    del entries[max(key for key in entries if key.startswith("('opt_state'"))]
    train_tree_file(step).write_text(json.dumps(tree))


DAMAGES = [
    truncate_a_file,
    delete_the_train_item,
    corrupt_the_metadata_json,
    empty_the_folder,
    drop_the_parameter_shapes,
    write_a_list_for_the_metadata,
    delete_the_train_tree,
    empty_the_train_tree,
    cut_the_train_tree,
    write_no_tree_for_the_train_item,
]


def _size(path: Path) -> int:
    return path.stat().st_size


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory) -> Path:
    """The undamaged run: 6 steps, checkpoints 2, 4 and 6."""
    workdir = tmp_path_factory.mktemp("damage") / "straight"
    run(load_config(None, [*ARGS, f"data.path={corpus}", f"run.workdir={workdir}"]))
    return workdir


def damaged_copy(straight: Path, folder: Path, damage, step: int = STEPS) -> Path:
    shutil.copytree(straight, folder)
    damage(folder / "checkpoints" / str(step))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(
    straight, corpus, tmp_path, damage, capfd
):
    workdir = damaged_copy(straight, tmp_path / "run", damage)
    damaged_files = sorted(p.name for p in (workdir / "checkpoints" / "6").rglob("*"))
    capfd.readouterr()
    run(load_config(None, [*ARGS, f"data.path={corpus}", f"run.workdir={workdir}"]))
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "does not restore" in line]
    assert len(warnings) == 1, err[-3000:]
    assert warnings[0].startswith(f"warning: checkpoint {workdir / 'checkpoints' / '6'} ")
    assert warnings[0].endswith("moved it to 6.damaged; trying the previous one")
    assert "Traceback" not in err
    assert f"resuming from {workdir / 'checkpoints' / '4'} (step 4)" in err
    kept = workdir / "checkpoints" / "6.damaged"
    assert sorted(p.name for p in kept.rglob("*")) == damaged_files, "kept aside as it was"
    assert (workdir / "checkpoints" / "6").is_dir(), "step 6 saved anew"
    assert [r["step"] for r in rows_of(workdir) if "loss" in r] == list(range(1, STEPS + 1))
    assert losses_of(workdir) == losses_of(straight)


@pytest.mark.slow
def test_every_checkpoint_damaged_exits_2_with_one_line(straight, corpus, tmp_path, repo_root):
    """Through the CLI, as a user sees it: each damage kind once (an empty folder `8` too), no
    traceback from Orbax's threads; the damaged folders are all kept."""
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    checkpoints = workdir / "checkpoints"
    (checkpoints / "8").mkdir()
    for step, damage in zip([6, 4, 2], DAMAGES, strict=False):
        damage(checkpoints / str(step))
    done = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml"]
        + [o for o in ARGS if not o.startswith("log.")]
        + [f"data.path={corpus}", f"run.workdir={workdir}"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert error_lines_of_a_user_error(done) == [
        f"error: no checkpoint in {checkpoints} restores (damaged ones moved aside: 2.damaged, "
        "4.damaged, 6.damaged, 8.damaged); start fresh with another run.workdir, or repair them "
        "(rename a repaired one back to its step number) and re-run"
    ], done.stderr[-3000:]
    assert done.stderr.count("does not restore") == 4
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "2.damaged",
        "4.damaged",
        "6.damaged",
        "8.damaged",
    ]


@pytest.mark.slow
def test_export_and_init_from_fall_back_and_leave_the_source_alone(straight, tmp_path, capfd):
    workdir = damaged_copy(straight, tmp_path / "run", lambda step: truncate_a_file(step, "params"))
    capfd.readouterr()
    out = export_params(workdir, tmp_path / "exported")
    config = load_config(None, ARGS)
    mesh = sharding.make_mesh(config.mesh)
    program = build_program(config, mesh, builder_for_vocab(config, 256))
    state = init_from(str(workdir), program, model_spec(config.model.kind))
    err = capfd.readouterr().err
    assert err.count(f"checkpoint {workdir / 'checkpoints' / '6'} does not restore") == 2, err
    assert "left in place" in err and "Traceback" not in err
    assert (workdir / "checkpoints" / "6").is_dir(), "another run's folder is never moved"
    exported = ocp.StandardCheckpointer().restore(out)
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # both step 4's


@pytest.mark.slow
def test_generate_falls_back_from_a_damaged_checkpoint(straight, tmp_path, capfd):
    workdir = damaged_copy(straight, tmp_path / "run", lambda step: truncate_a_file(step, "params"))
    prompt = list(b"def ")
    capfd.readouterr()
    ids = load_generator(str(workdir)).generate(prompt, max_new_tokens=8, temperature=0.0)
    err = capfd.readouterr().err
    assert err.splitlines() == [
        line for line in err.splitlines() if line.startswith("warning: checkpoint ")
    ], err[-3000:]
    assert err.count(f"checkpoint {workdir / 'checkpoints' / '6'} does not restore") == 1, err
    assert "left in place" in err
    assert (workdir / "checkpoints" / "6").is_dir(), "another run's folder is never moved"
    step_4 = load_generator(str(straight), step=4)
    np.testing.assert_array_equal(ids, step_4.generate(prompt, max_new_tokens=8, temperature=0.0))


@pytest.mark.slow
def test_generate_prints_only_the_text(straight, repo_root):
    """No warning from Orbax about options a read-only checkpoint folder cannot have."""
    done = subprocess.run(
        [sys.executable, "-m", "trainer.generate", "--workdir", str(straight), "--prompt", "def "]
        + ["--max-new-tokens", "8", "--temperature", "0"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""
    assert done.stdout.startswith("def ")


# Step 2 says the same shapes as step 1, but its last array is one element shorter: that read fails
# at once while the other 31 (1 MB each) are still being read. Orbax runs a restore on a fresh event
# loop, which it closed with those reads still pending; collected later, each printed an
# "Exception ignored in: <coroutine _read_array_index_and_device_put>" traceback.
FALLBACK_WHILE_READING = """
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from trainer.checkpoint import Checkpointer, param_shapes
from trainer.config import CheckpointConfig
from trainer.parallel.state import TrainState

folder = Path(sys.argv[1])
params = {f"w{i}": jax.random.normal(jax.random.key(i), (2**18,)) for i in range(32)}
meta = {"param_shapes": param_shapes(params)}
short = {**params, "w31": params["w31"][:-1]}
# Saved in the foreground: Orbax warns on stderr when a save waited over 1 s for the one before.
checkpointer = Checkpointer(folder, CheckpointConfig(**{"async": False}))
checkpointer.save(1, TrainState(jnp.int32(1), params, {}, {}), None, meta)
checkpointer.save(2, TrainState(jnp.int32(2), short, {}, {}), None, meta)
checkpointer.close()
checkpointer = Checkpointer(folder, CheckpointConfig())
target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
step, restored = checkpointer.restore_newest(lambda step: checkpointer.restore_params(step, target))
checkpointer.close()
same = all(bool((restored[k] == params[k]).all()) for k in params)
print(f"restored step {step}; same values: {same}")
"""


@pytest.mark.slow
def test_a_failed_restore_leaves_no_pending_read_behind(tmp_path, repo_root):
    """Three processes, as a user would meet it: each falls back to step 1 and exits without a
    traceback (before the fix, every one of them printed dozens here)."""
    for attempt in range(3):
        folder = tmp_path / f"checkpoints-{attempt}"
        done = subprocess.run(
            [sys.executable, "-c", FALLBACK_WHILE_READING, str(folder)],
            cwd=repo_root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout == "restored step 1; same values: True\n"
        assert "Exception ignored" not in done.stderr, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        [line] = done.stderr.splitlines()
        assert line.startswith(
            f"warning: checkpoint {folder / '2'} does not restore (Requested shape: (262144,) is "
            "not compatible with the stored shape: (262143,)."
        )
        assert line.endswith("); moved it to 2.damaged; trying the previous one")


# ------------------------------------------------------------- failures that show no damage
# Only evidence in a step's own files moves it aside. A read error of the storage (an NFS
# server's EIO or ESTALE at start-up), memory, an interrupt or a bug ends the run with every
# checkpoint where it was: moving a good one aside would resume from an older one unasked.

ALL_IN_PLACE = ["2", "4", "6"]


def checkpoint_folders(workdir: Path) -> list[str]:
    return sorted(p.name for p in (workdir / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_saved_config_without_its_precision_section_resumes_as_bfloat16(
    straight, corpus, tmp_path, capfd
):
    """Every version saved `precision`, in which bfloat16 is the default: a hand-edited config
    without the section means bfloat16, as `load_config` reads it. Before, a KeyError moved the
    checkpoint aside and the run resumed from an older one."""
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    shutil.rmtree(workdir / "checkpoints" / "6")
    meta_file = workdir / "checkpoints" / "4" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["config"]["precision"]
    meta_file.write_text(json.dumps(meta))
    capfd.readouterr()
    run(load_config(None, [*ARGS, f"data.path={corpus}", f"run.workdir={workdir}"]))
    err = capfd.readouterr().err
    assert "does not restore" not in err, err[-3000:]
    assert f"resuming from {workdir / 'checkpoints' / '4'} (step 4)" in err
    assert checkpoint_folders(workdir) == ALL_IN_PLACE
    assert losses_of(workdir) == losses_of(straight)


def eio_read() -> None:
    raise OSError(errno.EIO, "Input/output error")


async def interrupted_read(*_args, **_kwargs) -> None:
    raise KeyboardInterrupt  # as Ctrl-C's handler raises it in a read on the main thread


async def stopped_read(*_args, **_kwargs) -> None:
    raise Stopped("SIGTERM", loop_started=False)  # a Slurm requeue's SIGTERM during start-up


def out_of_memory_reading(item: str):
    """Orbax's JSON handler, that runs out of memory reading the item `item` of a step."""
    original = ocp.JsonCheckpointHandler.restore

    def restore(handler, directory, *args, **kwargs):
        if Path(directory).name == item:
            raise MemoryError
        return original(handler, directory, *args, **kwargs)

    return restore


def a_bug(*_args, **_kwargs) -> None:
    raise TypeError("a bug in the restore")


# (the call that fails, its stand-in, what the run raises, the start of its line)
NO_DAMAGE = {
    "eio_reading_the_data_position": (
        "trainer.checkpoint.reading.data_checkpointing.restore_position",
        lambda *_args: eio_read(),
        TrainingError,
        "cannot read checkpoint {step} (Input/output error [EIO]); it is left in place, as are "
        "the older ones: check the storage it is on and re-run, or rename it to 6.damaged to "
        "resume from the one before",
    ),
    "memory_error_reading_the_metadata": (
        "orbax.checkpoint.JsonCheckpointHandler.restore",
        out_of_memory_reading("meta"),
        TrainingError,
        "ran out of host memory while restoring checkpoint {step}; it is left in place",
    ),
    "ctrl_c_inside_orbaxs_read": (
        "orbax.checkpoint._src.serialization.serialization._read_shard",
        interrupted_read,
        KeyboardInterrupt,
        "",
    ),
    "sigterm_inside_orbaxs_read": (
        "orbax.checkpoint._src.serialization.serialization._read_shard",
        stopped_read,
        Stopped,
        "SIGTERM",
    ),
    "a_bug": ("trainer.checkpoint.reading.param_shapes", a_bug, TypeError, "a bug in the restore"),
    "a_bug_inside_orbaxs_restore": (  # the step's files are intact: still a bug, not damage
        "orbax.checkpoint.StandardCheckpointHandler.restore",
        a_bug,
        TypeError,
        "a bug in the restore",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", NO_DAMAGE, ids=list(NO_DAMAGE))
def test_a_failure_that_shows_no_damage_leaves_every_checkpoint_in_place(
    straight, corpus, tmp_path, case, monkeypatch, capfd
):
    target, stand_in, raised, line = NO_DAMAGE[case]
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    monkeypatch.setattr(target, stand_in)
    capfd.readouterr()
    with pytest.raises(raised) as failed:
        run(load_config(None, [*ARGS, f"data.path={corpus}", f"run.workdir={workdir}"]))
    assert str(failed.value).startswith(line.format(step=workdir / "checkpoints" / "6"))
    if raised is TypeError:  # a crash, whose traceback says it moved nothing
        assert failed.value.__notes__ == [
            f"checkpoint {workdir / 'checkpoints' / '6'} is left in place: this error shows no "
            "damage in it"
        ]
    assert "does not restore" not in capfd.readouterr().err
    assert checkpoint_folders(workdir) == ALL_IN_PLACE


# Read errors of the storage, made real: a preloaded library fails each read of the files whose
# path holds $FAIL_READS_OF with $FAIL_READS_ERRNO, as an NFS mount does after a server restart
# (ESTALE) or a network fault (EIO). TensorStore (the arrays) and Python (the JSON items) read
# through these calls.
FAILING_READS = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static int fails(int fd) {
    const char *part = getenv("FAIL_READS_OF");
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (!part || n <= 0) return 0;
    path[n] = 0;
    return strstr(path, part) != NULL;
}

#define FAILING(name, params, args)                                \
    ssize_t name params {                                          \
        static ssize_t (*real) params;                             \
        if (!real) real = dlsym(RTLD_NEXT, #name);                 \
        if (fails(fd)) {                                           \
            errno = atoi(getenv("FAIL_READS_ERRNO"));              \
            return -1;                                             \
        }                                                          \
        return real args;                                          \
    }

FAILING(read, (int fd, void *b, size_t n), (fd, b, n))
FAILING(pread, (int fd, void *b, size_t n, off_t o), (fd, b, n, o))
FAILING(pread64, (int fd, void *b, size_t n, off_t o), (fd, b, n, o))
FAILING(readv, (int fd, const struct iovec *v, int c), (fd, v, c))
FAILING(preadv, (int fd, const struct iovec *v, int c, off_t o), (fd, v, c, o))
"""


@pytest.fixture(scope="module")
def failing_reads(tmp_path_factory) -> Path:
    return preloadable_library(tmp_path_factory, "failing_reads", FAILING_READS)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("files", "code", "problem"),
    [
        ("params/ocdbt.process_0/d/", errno.EIO, "Input/output error [EIO]"),
        ("meta/metadata", errno.ESTALE, "Stale file handle [ESTALE]"),
    ],
    ids=["eio_in_tensorstore", "estale_in_python"],
)
def test_a_read_error_of_the_storage_exits_2_and_moves_nothing(
    straight, corpus, tmp_path, repo_root, failing_reads, files, code, problem
):
    """Through the CLI, as a requeued Slurm job meets a flaky NFS mount at start-up: one line,
    exit 2, the newest checkpoint still in place for the next attempt (before: moved aside to
    6.damaged, and the run went on from step 4)."""
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    newest = workdir / "checkpoints" / "6"
    done = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml"]
        + [o for o in ARGS if not o.startswith("log.")]
        + [f"data.path={corpus}", f"run.workdir={workdir}"],
        cwd=repo_root,
        env={
            **os.environ,
            "LD_PRELOAD": str(failing_reads),
            "FAIL_READS_OF": str(newest / files),
            "FAIL_READS_ERRNO": str(code),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert error_lines_of_a_user_error(done) == [
        f"error: cannot read checkpoint {newest} ({problem}); it is left in place, as are the "
        "older ones: check the storage it is on and re-run, or rename it to 6.damaged to resume "
        "from the one before"
    ], done.stderr[-3000:]
    assert "does not restore" not in done.stderr
    assert checkpoint_folders(workdir) == ALL_IN_PLACE


@pytest.mark.slow
def test_a_tree_of_another_layout_saved_with_this_runs_settings_is_not_called_a_setting_change(
    straight, corpus, tmp_path
):
    """A train/_METADATA of another tree in a checkpoint saved with this run's settings. Before:
    the line advised resuming "with the settings it was saved with", which are this run's. The
    checkpoint is left in place: nothing else in the step records its tree, so a damaged file
    and a changed model or optimizer code look the same."""
    workdir = damaged_copy(straight, tmp_path / "run", write_another_tree_for_the_train_item)
    with pytest.raises(ConfigError) as refused:
        run(load_config(None, [*ARGS, f"data.path={corpus}", f"run.workdir={workdir}"]))
    checkpoints = workdir / "checkpoints"
    assert str(refused.value) == (
        f"checkpoint {checkpoints / '6'} holds optimizer or model state laid out otherwise than "
        "this run's, though it was saved with this run's model.* and optim.* settings: its "
        "params/_METADATA or train/_METADATA is damaged, or the model's or optimizer's code "
        "changed since; rename 6 to 6.damaged to resume from the checkpoint before it, or start "
        f"a new run.workdir with checkpoint.init_from={workdir} to keep its weights"
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4", "6"]
