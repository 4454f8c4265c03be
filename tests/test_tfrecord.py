"""TFRecord data: prepared like ArrayRecord, read by Grain or tf.data into the same batches,
split between hosts, resumed exactly, and damaged shards named."""

import json
import shutil
from dataclasses import replace

import pytest
from conftest import documents, records_in, same, take
from skiplog import count_skipped

from input_pipeline import tfdata
from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.pipeline import make_batch_iterator
from input_pipeline.prepare import main as prepare_main
from input_pipeline.prepare import prepare_dataset
from input_pipeline.reading import Reading
from input_pipeline.tfrecords import any_readable_record
from trainer.config import load_config
from trainer.errors import ConfigError

READERS = ["grain", "tfdata"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The same corpus prepared in both formats."""
    root = tmp_path_factory.mktemp("formats")
    kw = dict(eval_fraction=0.1, num_shards=3, max_record_tokens=512, progress=False)
    prepare_dataset(documents(), root / "ar", format="arrayrecord", **kw)
    prepare_dataset(documents(), root / "tf", format="tfrecord", **kw)
    return load_dataset_info(root / "ar"), load_dataset_info(root / "tf")


def records_read(info, reader="auto", shuffle=True, index=0, count=1):
    """Every record of one epoch, rebuilt from packed rows (one record never spans rows)."""
    it = make_batch_iterator(
        info,
        "train",
        seq_len=512,
        batch_size=2,
        packing="first_fit",
        reading=Reading(
            shuffle=shuffle,
            seed=7,
            num_epochs=1,
            reader=reader,
            process_index=index,
            process_count=count,
        ),
    )
    return records_in(it)


def test_prepare_writes_tfrecord_shards_with_the_same_counts(datasets):
    ar, tf = datasets
    assert tf.raw["format"] == "tfrecord" and ar.raw["format"] == "arrayrecord"
    for split in ("train", "eval"):
        shards = tf.split(split)["shards"]
        assert all(s["file"].endswith(f"-of-{len(shards):05d}.tfrecord") for s in shards)
        strip = [{k: v for k, v in s.items() if k not in ("file", "sha256")} for s in shards]
        assert strip == [
            {k: v for k, v in s.items() if k not in ("file", "sha256")}
            for s in ar.split(split)["shards"]
        ]
    tf.verify_checksums()


@pytest.mark.parametrize("reader", READERS)
def test_both_formats_give_the_same_records_and_unshuffled_batches(datasets, reader):
    ar, tf = datasets
    expected = records_read(ar)
    assert sorted(records_read(tf, reader)) == sorted(expected)  # same multiset, shuffled
    assert len(expected) == ar.num_records("train")
    kw = dict(seq_len=48, batch_size=4)
    unshuffled = take(
        make_batch_iterator(tf, "train", reading=Reading(shuffle=False, reader=reader), **kw), 12
    )
    in_order = take(make_batch_iterator(ar, "train", reading=Reading(shuffle=False), **kw), 12)
    assert all(same(x, y) for x, y in zip(unshuffled, in_order, strict=True))


@pytest.mark.parametrize("reader", READERS)
def test_same_seed_same_batches_other_seed_differs(datasets, reader):
    _, tf = datasets
    kw = dict(seq_len=32, batch_size=4)
    a = take(make_batch_iterator(tf, "train", reading=Reading(seed=1, reader=reader), **kw), 5)
    b = take(make_batch_iterator(tf, "train", reading=Reading(seed=1, reader=reader), **kw), 5)
    c = take(make_batch_iterator(tf, "train", reading=Reading(seed=2, reader=reader), **kw), 5)
    assert all(same(x, y) for x, y in zip(a, b, strict=True))
    assert not all(same(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("reader", READERS)
def test_hosts_get_disjoint_shards_that_cover_the_split(datasets, reader):
    _, tf = datasets
    host0 = records_read(tf, reader, index=0, count=2)
    host1 = records_read(tf, reader, index=1, count=2)
    assert host0 and host1 and not set(host0) & set(host1)
    assert sorted(host0 + host1) == sorted(records_read(tf, reader))
    with pytest.raises(DataError, match="3 train shards for 4 readers.*--num-shards 4"):
        reading = Reading(process_count=4, reader=reader)
        make_batch_iterator(tf, "train", seq_len=8, batch_size=2, reading=reading)


@pytest.mark.parametrize(
    "reader, anchor_ratio",
    [("grain", None), ("tfdata", 0), ("tfdata", 1e9)],  # tf.data: anchor every batch / never
)
@pytest.mark.parametrize("shuffle", [True, False])
def test_state_round_trip_gives_the_next_batch(
    datasets, reader, anchor_ratio, shuffle, monkeypatch
):
    if anchor_ratio is not None:
        monkeypatch.setattr(tfdata, "ANCHOR_COST_RATIO", anchor_ratio)
        monkeypatch.setattr(tfdata, "PARSE_BATCH", 16)
    _, tf = datasets
    kw = dict(seq_len=128, batch_size=8, reading=Reading(shuffle=shuffle, seed=3, reader=reader))
    it = make_batch_iterator(tf, "train", **kw)
    take(it, tf.num_tokens("train") // (128 * 8) + 5)  # the state is past an epoch boundary
    state = json.loads(json.dumps(it.get_state()))  # as stored in a checkpoint
    if anchor_ratio is not None:  # restored from a fresh anchor, or re-reading many records
        replayed = found(state, "records_after")
        assert replayed < 16 if anchor_ratio == 0 else replayed > tf.num_records("train")
    expected = take(it, 3)
    fresh = make_batch_iterator(tf, "train", **kw)
    fresh.set_state(state)
    assert all(same(x, y) for x, y in zip(take(fresh, 3), expected, strict=True))


def found(state, key):
    """The value of `key` somewhere in a nested iterator state."""
    if isinstance(state, dict):
        if key in state:
            return state[key]
        state = list(state.values())
    if isinstance(state, list):
        hits = [found(x, key) for x in state]
        return next((h for h in hits if h is not None), None)
    return None


def damaged_copy(info, tmp_path, truncate):
    copy = tmp_path / "damaged"
    shutil.copytree(info.path, copy)
    shard = sorted(copy.glob("train-00001-*"))[0]
    data = bytearray(shard.read_bytes())
    if truncate:
        data = data[: len(data) // 2]
    else:
        for i in range(200, len(data) // 2):
            data[i] ^= 0x5A
    shard.write_bytes(bytes(data))
    return load_dataset_info(copy), shard


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("truncate", [True, False])
def test_damaged_shard_names_the_file_and_the_fix(datasets, tmp_path, reader, truncate):
    info, shard = damaged_copy(datasets[1], tmp_path, truncate)
    reading = Reading(shuffle=False, reader=reader)
    it = make_batch_iterator(info, "train", seq_len=64, batch_size=4, reading=reading)
    with pytest.raises(DataError, match=rf"shard .*{shard.name} is corrupt or truncated.*--over"):
        take(it, 400)


def test_skip_corrupt_reads_past_a_truncated_shard(datasets, tmp_path):
    info, _ = damaged_copy(datasets[1], tmp_path, truncate=True)
    log = tmp_path / "skipped.jsonl"
    reading = Reading(shuffle=False, num_epochs=1, skip_corrupt=True, skip_log=log)
    kw = dict(seq_len=64, batch_size=4)
    batches = list(make_batch_iterator(info, "train", reading=reading, **kw))
    full = list(make_batch_iterator(datasets[1], "train", reading=reading, **kw))
    assert 0 < len(batches) < len(full)
    # The record at the cut, and every record dataset.json lists after it (before: only the
    # one at the cut was counted, though the rest of the shard was lost with it).
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    lost = sorted(entry["record"] for entry in entries if "record" in entry)
    listed = info.split("train")["shards"][1]["records"]
    assert [entry for entry in entries if "offset" in entry] == entries[:1]
    assert lost == list(range(lost[0], listed))
    assert count_skipped(log) == len(entries) == 1 + len(lost)
    with pytest.raises(DataError, match="skip_corrupt=true is not supported by data.reader=tfd"):
        make_batch_iterator(info, "train", reading=replace(reading, reader="tfdata"), **kw)


@pytest.mark.parametrize("shuffle", [True, False])
def test_skip_log_lists_each_bad_record_once_however_many_epochs(datasets, tmp_path, shuffle):
    """Before: every epoch appended the same skipped record again (4 lines after 4 epochs)."""
    info, _ = damaged_copy(datasets[1], tmp_path, truncate=False)
    log = tmp_path / "skipped.jsonl"
    reading = Reading(shuffle=shuffle, num_epochs=4, skip_corrupt=True, skip_log=log)
    list(make_batch_iterator(info, "train", seq_len=64, batch_size=4, reading=reading))
    lines = log.read_text().splitlines()
    assert len(lines) == len(set(lines)) == count_skipped(log) >= 1


def test_bad_settings_and_missing_shards_name_the_fix(datasets, tmp_path):
    ar, tf = datasets
    with pytest.raises(DataError, match="reader=tfdata reads TFRecord.*--format tfrecord"):
        make_batch_iterator(ar, "train", seq_len=8, batch_size=2, reading=Reading(reader="tfdata"))
    with pytest.raises(ConfigError, match="data.reader"):
        load_config(None, ["data.reader=tfrecord"])
    copy = tmp_path / "copy"
    shutil.copytree(tf.path, copy)
    next(copy.glob("train-00002-*")).unlink()
    with pytest.raises(DataError, match=r"train-00002-of-00003\.tfrecord .* is missing"):
        make_batch_iterator(load_dataset_info(copy), "train", seq_len=8, batch_size=2)


def test_prepare_cli_writes_tfrecord(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "one document"}\n{"text": "and another"}\n')
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "*.jsonl"), "--output", str(out), "--eval-fraction", "0"]
    assert prepare_main([*args, "--format", "tfrecord"]) == 0
    info = load_dataset_info(out)
    assert info.format == "tfrecord" and info.num_records("train") == 2
    names = sorted(p.name for p in out.iterdir())
    shards = [f"train-0000{i}-of-00002.tfrecord" for i in range(2)]
    assert names == ["dataset.json", "prepared-shards.json", *shards]
    assert "error" not in capsys.readouterr().err


def rewritten(info, tmp_path, feature):
    """A copy of a TFRecord dataset whose records carry `feature(tokens)` instead of ours, with
    matching checksums: what a user's own writer could have made."""
    from input_pipeline.records import sha256_of
    from input_pipeline.tfrecords import tensorflow

    tf = tensorflow()
    copy = tmp_path / "rewritten"
    shutil.copytree(info.path, copy)
    raw = json.loads((copy / "dataset.json").read_text())
    for split in raw["splits"].values():
        for shard in split["shards"]:
            path = copy / shard["file"]
            records = list(tf.data.TFRecordDataset(str(path)).as_numpy_iterator())
            with tf.io.TFRecordWriter(str(path)) as writer:
                for record in records:
                    tokens = tf.train.Example.FromString(record).features.feature["tokens"]
                    features = tf.train.Features(feature=feature(tokens.int64_list.value))
                    writer.write(tf.train.Example(features=features).SerializeToString())
            shard["sha256"] = sha256_of(path)
    (copy / "dataset.json").write_text(json.dumps(raw))
    return load_dataset_info(copy)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", ["other name", "bytes", "outside the vocabulary"])
def test_records_of_another_layout_name_the_tokens_feature(datasets, tmp_path, reader, kind):
    """Before: an unknown feature name or a bytes feature hung both readers (every record read
    as empty), or was called a corrupt shard; tf.data took ids outside the vocabulary."""
    from input_pipeline.tfrecords import tensorflow

    tf = tensorflow()

    def feature(tokens):
        if kind == "other name":
            return {"input_ids": tf.train.Feature(int64_list=tf.train.Int64List(value=tokens))}
        if kind == "bytes":
            return {"tokens": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"abc"]))}
        ids = [t + 1000 for t in tokens]
        return {"tokens": tf.train.Feature(int64_list=tf.train.Int64List(value=ids))}

    info = rewritten(datasets[1], tmp_path, feature)
    said = {
        "other name": "has no 'tokens' feature \\(it has: input_ids\\)",
        "bytes": "holds 'tokens' as a bytes_list, not an int64_list",
        "outside the vocabulary": "holds token ids outside the vocabulary of 256",
    }[kind]
    it = make_batch_iterator(
        info, "train", seq_len=64, batch_size=2, reading=Reading(reader=reader)
    )
    with pytest.raises(DataError, match=f"train-0000.*: .*{said}; TFRecord data holds .*'tokens'"):
        next(it)


@pytest.mark.parametrize("reader", READERS)
def test_eval_with_fewer_shards_than_streams_counts_every_token(tmp_path, reader):
    """Before: the eval stream without a shard failed the first eval, after training."""
    from trainer.data import dataset_sources

    docs = documents()
    out = tmp_path / "one_eval_shard"
    prepare_dataset(
        docs[1:], out, eval_documents=docs[:1], num_shards=3, format="tfrecord", progress=False
    )
    info = load_dataset_info(out)
    assert len(info.split("eval")["shards"]) == 1
    pairs = info.num_tokens("eval") - info.num_records("eval")
    overrides = ["data.streams=2", "data.global_batch_size=4", "data.seq_len=64"]
    config = load_config(None, [f"data.path={out}", f"data.reader={reader}", *overrides])
    batches = dataset_sources(config.data, seed=0).make_eval()
    assert sum(float(b["weights"].sum()) for b in take(batches, 40)) == pairs


def garbled_copy(info, tmp_path, shards):
    """A copy whose train shards numbered `shards` hold records that are not tf.train.Examples,
    their framing intact: every record of those shards is unreadable."""
    from input_pipeline.tfrecords import tensorflow

    tf = tensorflow()
    copy = tmp_path / "garbled"
    shutil.copytree(info.path, copy)
    for i in shards:
        path = str(next(copy.glob(f"train-{i:05d}-*")))
        records = list(tf.data.TFRecordDataset(path).as_numpy_iterator())
        with tf.io.TFRecordWriter(path) as writer:
            for record in records:
                writer.write(b"\xff" * len(record))
    return load_dataset_info(copy)


@pytest.mark.parametrize("shuffle", [True, False])
def test_skip_corrupt_with_no_readable_record_is_an_error(datasets, tmp_path, shuffle):
    """Before: Grain's reader skipped every record of every epoch forever; the run hung."""
    info = garbled_copy(datasets[1], tmp_path, range(3))
    reading = Reading(shuffle=shuffle, skip_corrupt=True, skip_log=tmp_path / "skipped.jsonl")
    it = make_batch_iterator(info, "train", seq_len=64, batch_size=2, reading=reading)
    said = r"the 3 TFRecord shard\(s\) this reader reads hold no readable record \(first .*train-"
    with pytest.raises(DataError, match=f"{said}.*skipped every record.*--format tfrecord --over"):
        next(it)
    assert count_skipped(tmp_path / "skipped.jsonl") == info.num_records("train")


@pytest.mark.parametrize("shuffle", [True, False])
def test_skip_corrupt_reads_on_past_wholly_unreadable_shards(datasets, tmp_path, shuffle):
    info = garbled_copy(datasets[1], tmp_path, [0, 1])
    reading = Reading(shuffle=shuffle, skip_corrupt=True)
    it = make_batch_iterator(info, "train", seq_len=512, batch_size=2, reading=reading)
    assert all(b["weights"].sum() > 0 for b in take(it, 60))  # several epochs of shard 2


def test_no_readable_record_names_the_data_stream(datasets, tmp_path):
    """Before: with several data.streams the line said "this reader", which names none."""
    info = garbled_copy(datasets[1], tmp_path, range(3))
    reading = Reading(skip_corrupt=True, process_index=1, process_count=2)
    it = make_batch_iterator(info, "train", seq_len=64, batch_size=2, reading=reading)
    said = r"the 1 TFRecord shard\(s\) data stream 1 of 2 reads hold no readable record"
    with pytest.raises(DataError, match=f"{said} \\(first .*train-00001-"):
        next(it)


def test_a_shard_that_cannot_be_read_holds_no_readable_record(datasets, tmp_path):
    """TensorFlow's reader opens a folder and fails at its first read. Before: the probe for a
    readable record let that OSError out, a traceback."""
    folder = tmp_path / "train-00000-of-00001.tfrecord"
    folder.mkdir()
    shard = str(datasets[1].shard_paths("train")[0])
    assert not any_readable_record([str(folder)], vocab_size=256)
    assert any_readable_record([str(folder), shard], vocab_size=256)
