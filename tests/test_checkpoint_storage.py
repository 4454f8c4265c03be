"""A full or unwritable checkpoint folder is reported as such — never as a traceback from a
background writer thread — and the last complete checkpoint survives. The folders are real
tmpfs mounts of a few MB (needs root, which CI has; skipped with the reason otherwise)."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, tiny_run

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


@pytest.mark.slow
def test_a_save_that_cannot_fit_is_refused_before_writing(corpus, small_disk, repo_root):
    disk = small_disk("300k")
    done = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config", "configs/tiny.yaml"]
        + [o for o in TINY if not o.startswith("log.")]
        + [f"data.path={corpus}", f"run.workdir={disk}/run", "run.steps=4", "checkpoint.every=2"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert f"checkpoint folder {disk}/run/checkpoints has" in done.stderr
    assert "free but the save of step 2 needs about 1.3 MB" in done.stderr


@pytest.mark.slow
def test_disk_full_during_a_background_write_keeps_the_last_checkpoint(
    corpus, small_disk, monkeypatch
):
    # Room for one checkpoint of the tiny model (~1.3 MB) but not two; the free-space check
    # is disabled so the write itself runs out of space in Orbax's background thread.
    disk = small_disk("2200k")
    monkeypatch.setattr(Checkpointer, "_check_free_space", lambda *args: None)
    with pytest.raises(TrainingError, match=r"is full \(no space left on device\)") as err:
        run(tiny_run(corpus, disk / "run", steps=6))
    assert "step 2 is the last complete checkpoint" in str(err.value)
    checkpointer, step = Checkpointer.open_existing(disk / "run")
    checkpointer.close()
    assert step == 2


@pytest.mark.slow
def test_a_folder_that_turns_read_only_is_reported(corpus, small_disk):
    disk = small_disk("8m")
    run(tiny_run(corpus, disk / "run", steps=2))
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    with pytest.raises(TrainingError, match="not writable|cannot write run.workdir"):
        run(tiny_run(corpus, disk / "run", steps=4))
