"""A restart reads no shard it has already checked, and still catches every shard changed since:
every process hashed every shard at every start, so a run over hundreds of GB on shared storage
re-read all of it at each Slurm requeue before its first step."""

import json
import os
import shutil

import pytest

import input_pipeline.dataset_info as dataset_info
from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.verified import VerifiedShards, record_file
from trainer.config import load_config
from trainer.data import load_dataset


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The names of the shards read to hash them."""
    names = []
    real = dataset_info.sha256_of

    def counting(path):
        names.append(path.name)
        return real(path)

    monkeypatch.setattr(dataset_info, "sha256_of", counting)
    return names


@pytest.fixture
def copy(corpus, tmp_path):
    return shutil.copytree(corpus, tmp_path / "data")


def shards_of(folder) -> list[str]:
    info = load_dataset_info(folder)
    return [path.name for name in info.raw["splits"] for path in info.shard_paths(name)]


def test_a_restart_reads_no_shard_it_has_checked(copy, tmp_path, hashed):
    data = load_config(None, [f"data.path={copy}", f"data.cache_dir={tmp_path / 'cache'}"]).data
    load_dataset(data)
    assert sorted(hashed) == sorted(shards_of(copy))
    assert record_file(tmp_path / "cache", 0).is_file()
    hashed.clear()
    load_dataset(data)
    assert hashed == []


def test_a_shard_rewritten_since_its_check_is_read_again_and_refused(copy, tmp_path, hashed):
    """Same size and modification time (as `cp -p` or `rsync -t` keep them): the change time
    still tells."""
    record = VerifiedShards(record_file(tmp_path, 0))
    load_dataset_info(copy).verify_checksums(record)
    shard = copy / shards_of(copy)[0]
    before = shard.stat()
    body = bytearray(shard.read_bytes())
    body[len(body) // 2] ^= 0xFF
    shard.write_bytes(bytes(body))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    hashed.clear()
    with pytest.raises(DataError, match=f"shard {shard} does not match the checksum"):
        load_dataset_info(copy).verify_checksums(VerifiedShards(record_file(tmp_path, 0)))
    assert shard.name in hashed


def test_another_copy_at_the_same_path_is_read_again(copy, corpus, tmp_path, hashed):
    """A dataset copied anew to a node's disk under the same path is another file."""
    record = record_file(tmp_path, 0)
    load_dataset_info(copy).verify_checksums(VerifiedShards(record))
    shutil.rmtree(copy)
    shutil.copytree(corpus, copy)
    hashed.clear()
    load_dataset_info(copy).verify_checksums(VerifiedShards(record))
    assert sorted(hashed) == sorted(shards_of(copy))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", None])
def test_a_damaged_or_unwritable_record_only_costs_a_reread(copy, tmp_path, hashed, content):
    record = record_file(tmp_path / "cache", 0)
    if content is None:  # a file where its folder should be: nothing can be written there
        (tmp_path / "cache").write_text("")
    else:
        record.parent.mkdir()
        record.write_text(content)
    for _ in range(2):
        load_dataset_info(copy).verify_checksums(VerifiedShards(record))
    reads = 2 if content is None else 1
    assert sorted(hashed) == sorted(shards_of(copy) * reads)


def test_a_record_from_before_the_records_per_process_costs_one_reread(copy, tmp_path, hashed):
    """`verified-shards.json`, one file for every process with the device number in its stamps,
    is left as it is and not read: the first start after the upgrade checks every shard once."""
    cache = tmp_path / "cache"
    cache.mkdir()
    old = {}
    for path, sha256 in load_dataset_info(copy).checksums():
        st = path.stat()
        stamp = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
        old[os.path.realpath(path)] = [stamp, sha256]
    (cache / "verified-shards.json").write_text(json.dumps(old))
    data = load_config(None, [f"data.path={copy}", f"data.cache_dir={cache}"]).data
    load_dataset(data)
    assert sorted(hashed) == sorted(shards_of(copy))
    hashed.clear()
    load_dataset(data)
    assert hashed == []
    assert json.loads((cache / "verified-shards.json").read_text()) == old
