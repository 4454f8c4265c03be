"""A node dying under a user's 4-process run: the survivors' next collective fails with Gloo's
"Connection reset by peer" or "Connection closed by peer" (CPU), or with the runtime's heartbeat
timeout. Each survivor printed a traceback of JAX's internals (three of them around the
launcher's line naming the dead process); it must be one line saying that another process is
gone and what to do, with a failing status.

The trainer's `train` raises here the error a survivor got, word for word (local.sh 4, process 2
SIGKILLed at step 45): the two-process version of the event is
test_multihost.py's `test_killed_process_stops_its_peer_and_the_rerun_resumes`.
"""

import pytest

from trainer import main as trainer_main

GLOO = (
    "UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
    "[127.0.0.1]:8097: Connection reset by peer"
)
GLOO_CLOSED = (
    "UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection "
    "closed by peer [127.0.0.1]:37510"
)
HEARTBEAT = (
    "INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 2 heartbeat "
    "timeout. This indicates that the remote task has failed, got preempted, or crashed "
    "unexpectedly."
)


@pytest.mark.parametrize(
    "message", [GLOO, GLOO_CLOSED, HEARTBEAT], ids=["gloo_reset", "gloo_closed", "heartbeat"]
)
def test_a_survivor_of_a_dead_peer_ends_on_one_line(message, repo_root, monkeypatch, capsys):
    def peer_died(config, ends_process=False):
        raise RuntimeError(message)  # what jax.errors.JaxRuntimeError is

    monkeypatch.chdir(repo_root)
    monkeypatch.setattr(trainer_main, "train", peer_died)
    assert trainer_main.main(["--config", "configs/tiny.yaml"]) == 1
    first = message.splitlines()[0][:200]
    assert capsys.readouterr().err.splitlines() == [
        f"error: another process of this run is gone ({first}); the first to fail says why in "
        "its own log (or was killed: the launcher names it); re-run the same command to resume "
        "from the latest checkpoint"
    ]


@pytest.mark.parametrize(
    "message", ["INTERNAL: something else", "DATA_LOSS: read gs://b/x: Connection reset by peer"]
)
def test_other_runtime_errors_still_raise(message, repo_root, monkeypatch):
    """A bug is a traceback, as before; so is a storage connection reset (no peer of the run)."""

    def broken(config, ends_process=False):
        raise RuntimeError(message)

    monkeypatch.chdir(repo_root)
    monkeypatch.setattr(trainer_main, "train", broken)
    with pytest.raises(RuntimeError, match=message.split(":")[0]):
        trainer_main.main(["--config", "configs/tiny.yaml"])
