"""A restart reads no shard it has already checked, and still catches every shard changed since:
every process hashed every shard at every start, so a run over hundreds of GB on shared storage
re-read all of it at each Slurm requeue before its first step."""

import os
import shutil

import pytest

import input_pipeline.dataset_info as dataset_info
from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.verified import VERIFIED_FILE, VerifiedShards
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
    assert (tmp_path / "cache" / VERIFIED_FILE).is_file()
    hashed.clear()
    load_dataset(data)
    assert hashed == []


def test_a_shard_rewritten_since_its_check_is_read_again_and_refused(copy, tmp_path, hashed):
    """Same size and modification time (as `cp -p` or `rsync -t` keep them): the change time
    still tells."""
    record = VerifiedShards(tmp_path / VERIFIED_FILE)
    load_dataset_info(copy).verify_checksums(record)
    shard = copy / shards_of(copy)[0]
    before = shard.stat()
    body = bytearray(shard.read_bytes())
    body[len(body) // 2] ^= 0xFF
    shard.write_bytes(bytes(body))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    hashed.clear()
    with pytest.raises(DataError, match=f"shard {shard} does not match the checksum"):
        load_dataset_info(copy).verify_checksums(VerifiedShards(tmp_path / VERIFIED_FILE))
    assert shard.name in hashed


def test_another_copy_at_the_same_path_is_read_again(copy, corpus, tmp_path, hashed):
    """A dataset copied anew to a node's disk under the same path is another file."""
    record = tmp_path / VERIFIED_FILE
    load_dataset_info(copy).verify_checksums(VerifiedShards(record))
    shutil.rmtree(copy)
    shutil.copytree(corpus, copy)
    hashed.clear()
    load_dataset_info(copy).verify_checksums(VerifiedShards(record))
    assert sorted(hashed) == sorted(shards_of(copy))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", None])
def test_a_damaged_or_unwritable_record_only_costs_a_reread(copy, tmp_path, hashed, content):
    record = tmp_path / "cache" / VERIFIED_FILE
    if content is None:  # a file where its folder should be: nothing can be written there
        (tmp_path / "cache").write_text("")
    else:
        record.parent.mkdir()
        record.write_text(content)
    for _ in range(2):
        load_dataset_info(copy).verify_checksums(VerifiedShards(record))
    reads = 2 if content is None else 1
    assert sorted(hashed) == sorted(shards_of(copy) * reads)
