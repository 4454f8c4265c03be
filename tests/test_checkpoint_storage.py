"""A full or unwritable checkpoint folder is reported as such — never as a traceback from a
background writer thread — and the last complete checkpoint survives. The folders are real
tmpfs mounts of a few MB (needs root, which CI has; skipped with the reason otherwise)."""

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED_SCHEDULE, TINY, tiny_in_process, tiny_run

from trainer.checkpoint import Checkpointer
from trainer.errors import TrainingError
from trainer.train import run


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mount whose size the test chooses; unmounted afterwards."""
    mounts = []

    def mount(size: str, name: str = "disk") -> Path:
        folder = tmp_path / name
        folder.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}); needs root")
        mounts.append(folder)
        return folder

    yield mount
    for folder in reversed(mounts):
        subprocess.run(["umount", "-l", str(folder)], check=False)


def train_args(corpus, steps: int) -> list[str]:
    """The tiny model on `corpus` for `steps`, a checkpoint every 2 steps, the
    `SHARED_SCHEDULE`."""
    return (
        [o for o in TINY if not o.startswith("log.")]
        + [f"data.path={corpus}", f"run.steps={steps}", SHARED_SCHEDULE]
        + ["checkpoint.every=2", "eval.every=100", "log.tensorboard=false"]
    )


def train_cli(repo_root, launcher: list[str], corpus, workdir: Path, steps: int):
    """The tiny model trained by the CLI (`python LAUNCHER --config ...`), a checkpoint every
    2 steps; what it printed."""
    return subprocess.run(
        [sys.executable, *launcher, "--config", "configs/tiny.yaml"]
        + [*train_args(corpus, steps), f"run.workdir={workdir}"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_save_that_cannot_fit_is_refused_before_writing(corpus, small_disk, repo_root):
    disk = small_disk("300k")
    done = train_cli(repo_root, ["-m", "trainer.main"], corpus, disk / "run", steps=4)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert f"checkpoint folder {disk}/run/checkpoints has" in done.stderr
    assert "free but the save of step 2 needs about 1.3 MB" in done.stderr


@pytest.mark.slow
def test_disk_full_during_a_background_write_keeps_the_last_checkpoint(
    corpus, small_disk, repo_root
):
    # Room for one checkpoint of the tiny model (~1.3 MB) but not two; the free-space check
    # is disabled so the write itself runs out of space in Orbax's background thread. What
    # the user sees is the CLI's stderr: Orbax's threads log each failure with its traceback.
    disk = small_disk("2200k")
    without_free_space_check = (
        "import sys; from trainer.checkpoint import Checkpointer; "
        "Checkpointer._check_free_space = lambda *args: None; "
        "from trainer.main import main; sys.exit(main(sys.argv[1:]))"
    )
    done = train_cli(repo_root, ["-c", without_free_space_check], corpus, disk / "run", steps=6)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "is full (no space left on device)" in last
    assert "step 2 is the last complete checkpoint" in last
    checkpointer, step = Checkpointer.open_existing(disk / "run")
    checkpointer.close()
    assert step == 2


@pytest.mark.slow
def test_a_failed_background_save_leaves_the_process_as_it_found_it(
    corpus, small_disk, monkeypatch
):
    # A library caller's process: while saves run, Orbax's failure logs are held back and its
    # event loops drain (trainer/checkpoint/manager.py); both end with the run, even a failed one.
    policy, filters = asyncio.get_event_loop_policy(), list(logging.getLogger("absl").filters)
    disk = small_disk("2200k")
    monkeypatch.setattr(Checkpointer, "_check_free_space", lambda *args: None)
    with pytest.raises(TrainingError, match=r"is full \(no space left on device\)"):
        run(tiny_run(corpus, disk / "run", steps=6))
    assert asyncio.get_event_loop_policy() is policy
    assert logging.getLogger("absl").filters == filters


@pytest.mark.slow
def test_a_folder_that_turns_read_only_is_reported(corpus, small_disk):
    disk = small_disk("8m")
    run(tiny_run(corpus, disk / "run", steps=2))
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    with pytest.raises(TrainingError, match="not writable|cannot write run.workdir"):
        run(tiny_run(corpus, disk / "run", steps=4))


@pytest.mark.slow
def test_a_checkpoint_folder_that_takes_no_files_is_refused_before_training(
    corpus, small_disk, repo_root, tmp_path
):
    # The workdir is writable but its checkpoints/ is not (a read-only mount, or another
    # user's folder). Before, the run trained to its first save, whose Orbax writer threads
    # waited 300 s for a step folder that was never made, then printed a traceback each.
    (tmp_path / "run").mkdir()
    checkpoints = small_disk("8m", "run/checkpoints")
    tiny_in_process(train_args(corpus, 2), tmp_path / "run")  # step 2 saved; ends without an error
    subprocess.run(["mount", "-o", "remount,ro", str(checkpoints)], check=True)
    done = train_cli(repo_root, ["-m", "trainer.main"], corpus, tmp_path / "run", steps=4)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"checkpoint folder {checkpoints} is not writable (Read-only file system)" in last
    assert "while starting the run" in last and "step 2 is the last complete checkpoint" in last
    assert "step 3" not in done.stderr  # refused before the first step


REMOUNTED_READ_ONLY_BEFORE_STEP_4 = """
import subprocess, sys
from trainer.checkpoint import Checkpointer
from trainer.main import main
save = Checkpointer.save
def save_into_a_read_only_folder_at_step_4(self, step, *args):
    if step == 4:
        self.wait()
        subprocess.run(["mount", "-o", "remount,ro", str(self.directory)], check=True)
    return save(self, step, *args)
Checkpointer.save = save_into_a_read_only_folder_at_step_4
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_folder_that_turns_read_only_mid_run_stops_at_the_save(
    corpus, small_disk, repo_root, tmp_path
):
    (tmp_path / "run").mkdir()
    checkpoints = small_disk("8m", "run/checkpoints")
    launcher = ["-c", REMOUNTED_READ_ONLY_BEFORE_STEP_4]
    done = train_cli(repo_root, launcher, corpus, tmp_path / "run", steps=6)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"checkpoint folder {checkpoints} is not writable" in last
    assert "while saving step 4" in last and "step 2 is the last complete checkpoint" in last


@pytest.mark.parametrize(
    ("failure", "logged"),
    [
        (OSError(28, "No space left on device"), False),
        (ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device"), False),
        (ValueError("a bug"), True),
    ],
)
def test_a_write_that_failed_after_the_save_ended_is_not_a_traceback(failure, logged, caplog):
    """One of a save's writes that fails once a sibling's failure has ended the save is never
    awaited: collected, asyncio logged "Task exception was never retrieved" with its traceback
    after the run's own one line (the disk-full test above, in one of three full suite runs). A
    full or unwritable folder is the checkpointer's to say; any other failure is still logged."""
    from trainer.checkpoint.manager import background_failures_reported_by_us

    # a stopped in-process run before this one (`main.quiet_asyncio`) silenced asyncio's logger
    caplog.set_level(logging.ERROR, logger="asyncio")

    async def write():
        raise failure

    with background_failures_reported_by_us():
        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(write())
            loop.run_until_complete(asyncio.sleep(0))  # it fails; nobody asks for its result
        finally:
            loop.close()
        del task
    never_retrieved = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert bool(never_retrieved) == logged
