"""The JSON files prepare parts share (the plan, dataset.json, a group's done.json) and the
verified-shards record are replaced whole, under a temporary name no other writer uses."""

import json
import os
import threading

import pytest

from input_pipeline.atomic import write_json
from input_pipeline.prepare import prepare_dataset
from input_pipeline.staging import PLAN_FILE, open_staging

PLAN = {"groups": [["a.jsonl"]], "recipe": {"format": "arrayrecord"}}


def test_another_hosts_plan_being_written_under_our_pid_is_left_alone(tmp_path):
    """Prepare parts on two hosts write the same plan into the shared staging folder. The temp
    name was `.plan.json.<pid>`, the same for two hosts' processes of equal pids (containers):
    this part's rename took the other's half-written file, and the other's rename then failed."""
    staging = tmp_path / "staging"
    staging.mkdir()
    others = staging / f".{PLAN_FILE}.{os.getpid()}"  # the other host's, still being written
    others.write_text('{"groups": [')
    open_staging(staging, PLAN, shared=True)
    assert others.read_text() == '{"groups": ['
    assert json.loads((staging / PLAN_FILE).read_text()) == PLAN


def test_writers_of_one_pid_racing_on_one_file_all_succeed(tmp_path):
    """Threads share a pid as two hosts' processes may: each rename finds its own file, and the
    file always holds one writer's whole value."""
    path, errors = tmp_path / PLAN_FILE, []

    def write_many(writer: int) -> None:
        try:
            for n in range(200):
                write_json(path, {"writer": writer, "n": n})
        except OSError as err:
            errors.append(err)

    threads = [threading.Thread(target=write_many, args=(w,)) for w in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert json.loads(path.read_text())["n"] == 199
    assert sorted(p.name for p in tmp_path.iterdir()) == [PLAN_FILE]


def test_the_file_gets_the_permissions_of_any_new_file(tmp_path):
    """Not a private temp file's 0600: a dataset.json others read must stay readable to them."""
    (tmp_path / "plain").write_text("{}")
    write_json(tmp_path / "dataset.json", {})
    mode = (tmp_path / "dataset.json").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain").stat().st_mode & 0o777


def test_a_failed_rename_leaves_no_temporary_file(tmp_path):
    (tmp_path / "taken").mkdir()  # a folder where the file should go: the rename fails
    with pytest.raises(OSError):
        write_json(tmp_path / "taken", {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_another_hosts_staging_of_the_same_dataset_is_left_alone(tmp_path):
    """Every process of a multi-host run may prepare the same built-in corpus into a shared
    cache at once. `prepare` named its staging folder by pid, the same for two hosts' processes
    of equal pids (containers), and first deleted what it found there: the other's work."""
    others = tmp_path / f".data.tmp-{os.getpid()}"  # the other host's, still being written
    (others / "group-00000").mkdir(parents=True)
    (others / "group-00000" / "train.arrayrecord").write_bytes(b"half")
    prepare_dataset(["some text " * 50] * 8, tmp_path / "data", num_shards=1, progress=False)
    assert (others / "group-00000" / "train.arrayrecord").read_bytes() == b"half"
    assert (tmp_path / "data" / "dataset.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == [others.name]
