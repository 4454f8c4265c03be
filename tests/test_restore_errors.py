"""Several processes restoring one checkpoint agree on what to do with it: a damage only one of
them reads moves it aside for all (each then falls back to the same older step), and a failure
that shows no damage on any one of them (a read error of its NFS mount) stops every process with
the checkpoint left in place."""

from pathlib import Path

import pytest
from test_multihost import on_two_joined_processes

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
