"""A restart reads no shard it has already checked, and still catches every shard changed since:
every process hashed every shard at every start, so a run over hundreds of GB on shared storage
re-read all of it at each Slurm requeue before its first step."""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SHARED_SCHEDULE, TINY

import input_pipeline.dataset_info as dataset_info
from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.prepare import prepare_dataset
from input_pipeline.verified import PREPARED_FILE, VerifiedShards, record_file, shared_stamp
from trainer.config import load_config
from trainer.data import load_dataset, load_sources, train_reading
from trainer.train import run as train


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


def prepare_small(folder):
    """A small dataset prepared into `folder` now, untouched since."""
    texts = [f"def f{i}(x):\n    return x + {i}\n" * (5 + i % 20) for i in range(240)]
    return prepare_dataset(texts, folder, eval_fraction=0.1, progress=False)


@pytest.fixture
def prepared(tmp_path):
    return prepare_small(tmp_path / "prepared")


@pytest.fixture
def copy(corpus, tmp_path):
    return shutil.copytree(corpus, tmp_path / "data")


def shards_of(folder) -> list[str]:
    info = load_dataset_info(folder)
    return [path.name for name in info.raw["splits"] for path in info.shard_paths(name)]


def check_said(what: str) -> str:
    """The line a check by one process says before it reads `what` ("8 shards (1.8 MB)")."""
    return (
        f"checking the sha256 of {what} before training; a one-time check: later starts skip "
        "the shards that pass it and are unchanged since (data.verify_checksums=false turns it "
        "off)\n"
    )


def touch(shard) -> None:
    """Another modification time for `shard`, as any write gives it (a write within the same
    clock tick as the last one may keep the times)."""
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def bytes_of(*folders) -> int:
    return sum(path.stat().st_size for f in folders for path, _ in load_dataset_info(f).checksums())


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


def test_a_first_start_says_what_it_reads_and_a_restart_that_reads_nothing_is_silent(
    copy, tmp_path, capsys
):
    """A first start over hundreds of GB read for an hour before its first step without a word,
    as if hung: it now says first how many shards and bytes it reads, once only, and how to
    skip it. A restart that knows every shard says nothing."""
    data = load_config(None, [f"data.path={copy}", f"data.cache_dir={tmp_path / 'cache'}"]).data
    load_dataset(data)
    said = f"{len(shards_of(copy))} shards ({bytes_of(copy) / 1e6:.1f} MB)"
    assert capsys.readouterr().err == check_said(said)
    load_dataset(data)
    assert capsys.readouterr().err == ""
    shard = copy / shards_of(copy)[0]
    touch(shard)  # written since: checked again
    load_dataset(data)
    said = f"1 shard ({shard.stat().st_size / 1e3:.1f} kB)"
    assert capsys.readouterr().err == check_said(said)


def test_the_datasets_of_a_mixture_are_checked_after_one_line_for_all(
    copy, corpus, tmp_path, capsys, hashed
):
    other = shutil.copytree(corpus, tmp_path / "other")
    data = load_config(
        None,
        [
            f"data.mixture=[{{path: '{copy}', weight: 1}}, {{path: '{other}', weight: 1}}]",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
    ).data
    load_sources(data, train_reading(data, seed=0))
    shards = len(shards_of(copy)) + len(shards_of(other))
    said = f"{shards} shards ({bytes_of(copy, other) / 1e6:.1f} MB)"
    assert capsys.readouterr().err == check_said(said)
    assert len(hashed) == shards


def test_a_listing_without_any_checksum_reads_nothing(copy, tmp_path, hashed, capsys):
    """Nothing to compare with: every shard was read for nothing."""
    info = json.loads((copy / "dataset.json").read_text())
    for split in info["splits"].values():
        for shard in split["shards"]:
            del shard["sha256"]
    (copy / "dataset.json").write_text(json.dumps(info))
    load_dataset_info(copy).verify_checksums(VerifiedShards(record_file(tmp_path, 0)))
    assert (hashed, capsys.readouterr().err) == ([], "")


def test_two_runs_saving_one_record_keep_each_others_shards(copy, tmp_path):
    """Two runs started at once on one cache folder, each its process 0: the record saved last
    held only its own shards, so the other run's were read again at its next start."""
    record = record_file(tmp_path / "cache", 0)
    first, second = shards_of(copy)[:2]
    runs = [VerifiedShards(record), VerifiedShards(record)]  # both read it before either saves
    for run, name in zip(runs, (first, second), strict=True):
        run.add(copy / name, shared_stamp(copy / name), f"sha of {name}")
        run.save()
    again = VerifiedShards(record)
    for name in (first, second):
        assert again.known(copy / name, shared_stamp(copy / name), f"sha of {name}"), name


def test_a_record_saved_meanwhile_keeps_none_of_its_shards_changed_since(copy, tmp_path):
    """What the other run saved of a shard rewritten since is not taken over, and a newer check
    of a shard is not undone by an older one saved meanwhile."""
    record = record_file(tmp_path / "cache", 0)
    changed, rechecked = (copy / name for name in shards_of(copy)[:2])
    stale = VerifiedShards(record)
    stale.add(rechecked, shared_stamp(rechecked), "old sha")
    stale.save()
    late = VerifiedShards(record)  # reads the old check of `rechecked`
    other = VerifiedShards(record)
    other.add(changed, shared_stamp(changed), "sha of changed")
    touch(rechecked)
    other.add(rechecked, shared_stamp(rechecked), "new sha")
    other.save()
    touch(changed)
    late.save()
    again = VerifiedShards(record)
    assert again.known(rechecked, shared_stamp(rechecked), "new sha")
    assert json.loads(record.read_text()).keys() == {os.path.realpath(rechecked)}


def test_a_save_drops_the_shards_gone_since_its_own_and_those_saved_meanwhile(
    copy, corpus, tmp_path
):
    """A record kept every shard it ever matched: a home cache folder held 943 of its 983
    entries for datasets deleted long ago. A save now leaves out the shards gone, of its own
    entries and of those another run saved meanwhile; the shards still there stay known."""
    record = record_file(tmp_path / "cache", 0)
    gone, gone_too = (Path(shutil.copytree(corpus, tmp_path / name)) for name in ("a", "b"))
    kept = [copy / name for name in shards_of(copy)[:2]]
    ours, theirs = VerifiedShards(record), VerifiedShards(record)
    for run, still, deleted in ((ours, kept[0], gone), (theirs, kept[1], gone_too)):
        for shard in [still, *deleted.glob("train-*")]:
            run.add(shard, shared_stamp(shard), f"sha of {shard.name}")
    theirs.save()
    shutil.rmtree(gone)
    shutil.rmtree(gone_too)
    ours.save()
    assert json.loads(record.read_text()) == {
        os.path.realpath(shard): [":".join(map(str, shared_stamp(shard))), f"sha of {shard.name}"]
        for shard in kept
    }


def test_a_shard_the_storage_cannot_read_is_one_line_and_the_others_are_recorded(
    copy, tmp_path, monkeypatch
):
    """An I/O error of the storage (NFS gives EIO) ended a one-process start in a traceback."""
    failing = copy / shards_of(copy)[1]
    real = dataset_info.sha256_of

    def failing_storage(path):
        if path == failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real(path)

    monkeypatch.setattr(dataset_info, "sha256_of", failing_storage)
    data = load_config(None, [f"data.path={copy}", f"data.cache_dir={tmp_path / 'cache'}"]).data
    with pytest.raises(DataError) as raised:
        load_dataset(data)
    assert str(raised.value) == (
        f"cannot read shard {failing} to check it (Input/output error); repair that storage or "
        "restore the shard (data.verify_checksums=false skips this)"
    )
    entries = json.loads(record_file(tmp_path / "cache", 0).read_text())
    assert {os.path.basename(path) for path in entries} == set(shards_of(copy)) - {failing.name}


# ----------------------------------------------------------------------------- after prepare


def start(dataset, tmp_path) -> None:
    """What a start checks of `dataset`, with a record of its own (none yet)."""
    load_dataset(load_config(None, [f"data.path={dataset}", f"data.cache_dir={tmp_path}"]).data)


def test_the_first_training_after_prepare_reads_no_shard_prepare_hashed(
    prepared, tmp_path, hashed, capsys
):
    """prepare reads every shard back for its sha256; the first start read them all again (an
    hour over 472 GB on NFS before step 1). It now trusts the shards whose stamp is still the
    one prepare recorded, as a restart trusts its own record."""
    capsys.readouterr()
    config = load_config(
        None,
        [
            *TINY,
            f"data.path={prepared}",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"run.workdir={tmp_path / 'run'}",
            "run.steps=2",
            SHARED_SCHEDULE,
            "checkpoint.every=100",
            "eval.every=100",
        ],
    )
    train(config)
    assert hashed == []
    assert "checking the sha256" not in capsys.readouterr().err


def test_a_shard_touched_or_rewritten_after_prepare_is_read_and_a_changed_one_refused(
    prepared, tmp_path, hashed, capsys
):
    touched, changed = (prepared / name for name in shards_of(prepared)[:2])
    touch(touched)
    capsys.readouterr()
    start(prepared, tmp_path / "cache")
    assert hashed == [touched.name]
    assert capsys.readouterr().err == check_said(f"1 shard ({touched.stat().st_size / 1e3:.1f} kB)")
    data = bytearray(changed.read_bytes())
    data[-100] ^= 0xFF  # one byte, in place: the same file, the same size
    with changed.open("r+b") as f:
        f.write(data)
    touch(changed)  # a write within the clock tick of the last change may keep the times
    with pytest.raises(DataError, match=f"shard {changed} does not match the checksum"):
        start(prepared, tmp_path / "cache")
    assert hashed == [touched.name, changed.name]


def test_a_copy_of_a_prepared_dataset_is_read(prepared, tmp_path, hashed):
    """`cp -a` keeps the modification times, not the inode numbers or change times: a copy may
    differ from what prepare read, so each of its shards is read."""
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(prepared), str(copy)], check=True)
    assert (copy / PREPARED_FILE).exists()
    start(copy, tmp_path / "cache")
    assert sorted(hashed) == sorted(shards_of(copy))


@pytest.mark.parametrize("record", [None, "not json", "[]", '{"train-00000": ["0:0:0:0"]}'])
def test_a_dataset_prepared_without_a_record_of_stamps_is_read_as_before(
    prepared, tmp_path, hashed, capsys, record
):
    """A dataset prepared before prepare recorded the stamps (its dataset.json is as it was),
    or with that record damaged: every shard is read, after the line saying so."""
    if record is None:
        (prepared / PREPARED_FILE).unlink()
    else:
        (prepared / PREPARED_FILE).write_text(record)
    capsys.readouterr()
    start(prepared, tmp_path / "cache")
    assert sorted(hashed) == sorted(shards_of(prepared))
    said = f"{len(shards_of(prepared))} shards ({bytes_of(prepared) / 1e6:.1f} MB)"
    assert capsys.readouterr().err == check_said(said)


def test_prepare_records_each_shards_final_stamp_and_leaves_dataset_json_as_it_was(prepared):
    """The record is taken after each shard's last rename; dataset.json lists no stamp, so the
    same data prepared again (or on another host) keeps its fingerprint."""
    record = json.loads((prepared / PREPARED_FILE).read_text())
    info = load_dataset_info(prepared)
    assert record == {
        path.name: [":".join(map(str, shared_stamp(path))), sha] for path, sha in info.checksums()
    }
    listed = [shard for split in info.raw["splits"].values() for shard in split["shards"]]
    assert {key for shard in listed for key in shard} == {"file", "records", "tokens", "sha256"}
