"""Damaged TFRecord data read without the checksum check at start (`data.verify_checksums=false`,
or `data.skip_corrupt=true`, which turns a checksum mismatch into a warning): a damaged record is
an error naming the shard, or with `skip_corrupt` a skip that is logged and counted, never other
tokens read in silence, and a shard that lost records is never read as a shorter one. Also:
ArrayRecord shards and dataset.json listings that disagree, and a mixture's batch left in Grain
workers' shared memory."""

import json
import mmap
import shutil
import struct
import subprocess
from collections import Counter

import numpy as np
import pytest
from conftest import documents, records_in, tiny_cli
from skiplog import count_skipped

from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.mixture import MixedStream
from input_pipeline.pipeline import make_batch_iterator
from input_pipeline.prepare import prepare_dataset
from input_pipeline.reading import Reading
from input_pipeline.tfrecords import TFRecordShard

RUN_TIMEOUT_S = 240  # a tiny run takes seconds; a hang never ends


@pytest.fixture(scope="module")
def tfrecords(tmp_path_factory):
    """A small TFRecord dataset: 2 train shards, an eval split."""
    out = tmp_path_factory.mktemp("tfrecords") / "tf"
    kw = dict(eval_fraction=0.1, num_shards=2, max_record_tokens=512, progress=False)
    return prepare_dataset(documents(), out, format="tfrecord", **kw)


def record_spans(shard) -> list[tuple[int, int]]:
    """(offset, payload length) of each record of a TFRecord shard, from its framing."""
    data, spans, offset = shard.read_bytes(), [], 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        spans.append((offset, length))
        offset += 16 + length
    return spans


def damaged_copy(dataset, tmp_path, damage) -> tuple:
    """A copy of `dataset` whose train shard 0 `damage` rewrites; the copy's info and shard."""
    copy = tmp_path / "damaged"
    shutil.copytree(dataset, copy)
    shard = next(copy.glob("train-00000-*"))
    damage(shard)
    return load_dataset_info(copy), shard


def flip_payload_byte(record: int):
    """Flip one byte in the middle of record `record`'s payload; its framing stays intact."""

    def damage(shard):
        offset, length = record_spans(shard)[record]
        data = bytearray(shard.read_bytes())
        data[offset + 12 + length // 2] ^= 0x01
        shard.write_bytes(bytes(data))

    return damage


def empty(shard):
    shard.write_bytes(b"")


def cut_after(records: int):
    """Cut the shard at a record boundary, after its first `records` records."""

    def damage(shard):
        offset, _ = record_spans(shard)[records]
        shard.write_bytes(shard.read_bytes()[:offset])

    return damage


def append_records(records: int):
    """Append a copy of the shard's first `records` records: it holds more than listed."""

    def damage(shard):
        offset, _ = record_spans(shard)[records]
        data = shard.read_bytes()
        shard.write_bytes(data + data[:offset])

    return damage


def every_record_flipped(shard):
    """Flip a payload byte of every record: none passes its CRC check, the framing holds."""
    data = bytearray(shard.read_bytes())
    for offset, length in record_spans(shard):
        data[offset + 12 + length // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def records_of(info, reader="grain", skip_log=None) -> list[bytes]:
    """Every record of one unshuffled pass over the train split, rebuilt from packed rows."""
    reading = Reading(
        shuffle=False,
        num_epochs=1,
        reader=reader,
        skip_corrupt=skip_log is not None,
        skip_log=skip_log,
    )
    it = make_batch_iterator(
        info, "train", seq_len=512, batch_size=2, packing="first_fit", reading=reading
    )
    return records_in(it)


def test_a_flipped_byte_in_a_record_is_an_error_not_other_tokens(tfrecords, tmp_path):
    """Before: Grain's TFRecord reader checks no CRC, so the record was read with one token
    changed, in silence (tf.data's reader caught it)."""
    info, shard = damaged_copy(tfrecords, tmp_path, flip_payload_byte(3))
    with pytest.raises(DataError, match=rf"shard .*{shard.name} is corrupt.*CRC.*--overwrite"):
        records_of(info)


def test_skip_corrupt_skips_and_counts_a_record_with_a_flipped_byte(tfrecords, tmp_path):
    """Before: nothing was skipped or counted, and the changed record was trained on."""
    info, _ = damaged_copy(tfrecords, tmp_path, flip_payload_byte(3))
    log = tmp_path / "skipped.jsonl"
    read = records_of(info, skip_log=log)
    clean = records_of(load_dataset_info(tfrecords))
    assert count_skipped(log) == 1
    assert not Counter(read) - Counter(clean)  # no record read changed
    assert sum((Counter(clean) - Counter(read)).values()) == 1


@pytest.mark.parametrize(
    ("damage", "reader"),
    [(empty, "grain"), (cut_after(2), "grain"), (empty, "tfdata"), (cut_after(2), "tfdata")],
    ids=["empty-grain", "cut-grain", "empty-tfdata", "cut-tfdata"],
)
def test_a_shard_that_lost_whole_records_is_an_error(tfrecords, tmp_path, damage, reader):
    """Before: a zero-length shard (a failed copy), or one cut between two records, was read as
    a shorter one: its records were left out of training without a word (with tf.data, the cut
    one until this session)."""
    info, shard = damaged_copy(tfrecords, tmp_path, damage)
    with pytest.raises(DataError, match=rf"shard .*{shard.name} .*records.*--overwrite"):
        records_of(info, reader)


@pytest.mark.parametrize(("reader", "skip"), [("grain", False), ("grain", True), ("tfdata", False)])
def test_a_shard_holding_more_records_than_listed_is_an_error(tfrecords, tmp_path, reader, skip):
    """Before: both readers read such a shard in full, records dataset.json does not list among
    them (ArrayRecord refuses the same mismatch at open, data.skip_corrupt or not)."""
    info, shard = damaged_copy(tfrecords, tmp_path, append_records(3))
    said = rf"shard .*{shard.name} holds more than the \d+ records .*dataset.json lists.*--over"
    with pytest.raises(DataError, match=said):
        records_of(info, reader, tmp_path / "skipped.jsonl" if skip else None)


def test_skip_corrupt_counts_every_record_a_damaged_shard_lost(tfrecords, tmp_path):
    """A length field garbled after record 2: the rest of the shard cannot be framed. Before:
    one skipped record was counted for all the records lost after it."""

    def garble_length(shard):
        offset, _ = record_spans(shard)[2]
        data = bytearray(shard.read_bytes())
        data[offset + 1] ^= 0x5A
        shard.write_bytes(bytes(data))

    info, _ = damaged_copy(tfrecords, tmp_path, garble_length)
    log = tmp_path / "skipped.jsonl"
    read = records_of(info, skip_log=log)
    listed = info.split("train")["shards"][0]["records"]
    assert count_skipped(log) == listed - 2
    assert len(read) == info.num_records("train") - (listed - 2)


def cli_args(path, *more: str) -> list[str]:
    """A 2-step run of the dataset at `path`, unshuffled, without its checksum check."""
    return [
        f"data.path={path}",
        "data.verify_checksums=false",
        "data.shuffle=false",
        "run.steps=2",
        "eval.every=100",
        "checkpoint.every=100",
        "log.tensorboard=false",
        "log.progress=false",
        *more,
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "reader"),
    [
        (flip_payload_byte(0), "grain"),
        (empty, "tfdata"),
        (cut_after(2), "tfdata"),
        (append_records(3), "tfdata"),
    ],
    ids=["flipped-grain", "empty-tfdata", "cut-tfdata", "more-tfdata"],
)
def test_the_cli_says_one_line_and_exits_2(tfrecords, tmp_path, repo_root, damage, reader):
    info, shard = damaged_copy(tfrecords, tmp_path, damage)
    last = last_line_of_a_refused_run(
        cli_args(info.path, f"data.reader={reader}"), tmp_path, repo_root
    )
    assert last.startswith(f"error: shard {shard}"), last


@pytest.mark.slow
def test_the_cli_names_the_data_stream_with_no_readable_record(tfrecords, tmp_path, repo_root):
    """Two data streams, one TFRecord shard each: the first's every record fails its CRC."""
    info, shard = damaged_copy(tfrecords, tmp_path, every_record_flipped)
    args = cli_args(info.path, "data.streams=2", "data.skip_corrupt=true")
    last = last_line_of_a_refused_run(args, tmp_path, repo_root)
    said = "error: the 1 TFRecord shard(s) data stream 0 of 2 reads hold no readable record "
    assert last.startswith(f"{said}(first {shard})"), last


def last_line_of_a_refused_run(args: list[str], tmp_path, repo_root) -> str:
    """The CLI's last stderr line on the tiny config with `args`, which must end in exit 2
    without a traceback."""
    proc = subprocess.run(
        tiny_cli(args, tmp_path / "run"),
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def arrayrecords(tmp_path_factory):
    """A small ArrayRecord dataset: 2 train shards, an eval split."""
    out = tmp_path_factory.mktemp("arrayrecords") / "ar"
    kw = dict(eval_fraction=0.1, num_shards=2, max_record_tokens=512, progress=False)
    return prepare_dataset(documents(), out, **kw)


def edited_copy(dataset, tmp_path, edit):
    """A copy of `dataset` whose dataset.json `edit` changes (in its parsed JSON); the shards
    are untouched, so their checksums still match."""
    copy = tmp_path / "edited"
    shutil.copytree(dataset, copy)
    info = json.loads((copy / "dataset.json").read_text())
    edit(info)
    (copy / "dataset.json").write_text(json.dumps(info))
    return copy


def listing(change: int):
    """List `change` more records for train shard 0 (and its split) than the shard holds."""

    def edit(info):
        info["splits"]["train"]["shards"][0]["records"] += change
        info["splits"]["train"]["records"] += change

    return edit


def without_a_checksum(info):
    del info["splits"]["train"]["shards"][0]["sha256"]


def token_dtype(dtype: str):
    def edit(info):
        info["token_dtype"] = dtype

    return edit


@pytest.mark.parametrize("change", [5, -5], ids=["more", "fewer"])
def test_a_shard_holding_other_records_than_listed_is_one_line(arrayrecords, tmp_path, change):
    """Before: 5 more listed was a ValueError traceback from inside array_record once a read
    reached past the shard's end (with data.skip_corrupt too); 5 fewer left 5 records unread
    without a word."""
    info = load_dataset_info(edited_copy(arrayrecords, tmp_path, listing(change)))
    said = r"shard .*train-00000-.* holds \d+ records but .*dataset.json lists \d+.*--overwrite"
    for skip in (False, True):
        with pytest.raises(DataError, match=said):
            records_of(info, "auto", tmp_path / "skipped.jsonl" if skip else None)


@pytest.mark.slow
@pytest.mark.parametrize(
    "edit",
    [listing(5), without_a_checksum, token_dtype("<u2")],
    ids=["listing-past-the-shard", "no-sha256", "token-dtype"],
)
def test_the_cli_names_the_dataset_json_an_edit_damaged(arrayrecords, tmp_path, repo_root, edit):
    copy = edited_copy(arrayrecords, tmp_path, edit)
    args = [f"data.path={copy}", "run.steps=2", "eval.every=100", "log.tensorboard=false"]
    last = last_line_of_a_refused_run(args, tmp_path, repo_root)
    assert f"{copy / 'dataset.json'}" in last and last.endswith("--overwrite"), last


def test_a_split_whose_shards_do_not_add_up_is_refused_at_load(arrayrecords, tmp_path):
    """Before: an eval split listing no shards for its 6 records loaded, trained, and stopped at
    its first eval with "the eval data yields no batch"."""

    def unlisted(info):
        info["splits"]["eval"]["shards"] = []

    copy = edited_copy(arrayrecords, tmp_path, unlisted)
    said = r"dataset.json: splits.eval.records is \d+ but its shards list 0 .*--overwrite"
    with pytest.raises(DataError, match=said):
        load_dataset_info(copy)


def test_a_shard_listed_without_its_checksum_is_refused_at_load(arrayrecords, tmp_path):
    """Before: the other shards were checked and that one skipped, without a word: a changed
    shard behind a listing that lost its sha256 was read as if checked."""
    copy = edited_copy(arrayrecords, tmp_path, without_a_checksum)
    said = r"dataset.json: splits.train.shards\[0\] \(train-00000-.*\) has no sha256 while other"
    with pytest.raises(DataError, match=f"{said}.*--overwrite"):
        load_dataset_info(copy)


def test_a_listing_without_any_checksum_loads(arrayrecords, tmp_path):
    """A listing written by hand for other data (prepare writes a sha256 per shard) may have
    none: nothing to check, so nothing is refused."""

    def no_checksums(info):
        for split in info["splits"].values():
            for shard in split["shards"]:
                del shard["sha256"]

    info = load_dataset_info(edited_copy(arrayrecords, tmp_path, no_checksums))
    info.verify_checksums()
    assert records_of(info, "auto") == records_of(load_dataset_info(arrayrecords), "auto")


def test_an_edited_token_dtype_names_the_dataset_json(arrayrecords, tmp_path):
    """Before: "a record of 31 bytes is not a whole number of uint16 tokens; the shard is
    corrupt: re-run python -m input_pipeline.prepare", naming no file, and blaming a shard."""
    copy = edited_copy(arrayrecords, tmp_path, token_dtype("<u2"))
    said = rf"not a whole number of uint16 tokens, the token_dtype {copy / 'dataset.json'} lists"
    with pytest.raises(DataError, match=f"{said}.*restore that dataset.json or re-run"):
        records_of(load_dataset_info(copy), "auto")


def test_a_token_dtype_too_narrow_for_the_vocabulary_is_refused_at_load(arrayrecords, tmp_path):
    """Before: a listing of |u1 tokens for a vocabulary of 1000 loaded, and its shards' 2-byte
    tokens would be read as twice as many byte ids, without a word."""

    def narrow(info):
        info["vocab_size"], info["token_dtype"] = 1000, "|u1"

    copy = edited_copy(arrayrecords, tmp_path, narrow)
    said = r"dataset.json: token_dtype \|u1 holds ids below 256, not the vocab_size of 1000"
    with pytest.raises(DataError, match=f"{said}.*--overwrite"):
        load_dataset_info(copy)


def in_shared_memory(value: np.ndarray) -> bool:
    """Whether `value` lies in a memory map (through its views): a Grain worker's batch."""
    base = value.base
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)


@pytest.mark.slow
def test_a_mixture_holds_no_batch_in_grain_workers_shared_memory(arrayrecords):
    """The batch a mixture keeps in hand per source stayed in a Grain worker's shared memory,
    held until the exit: every data.mixture run with data.workers ended its stderr (after its
    error line, where it had one) with Python's "There appear to be 5 leaked shared_memory
    objects" warning."""
    info = load_dataset_info(arrayrecords)
    reading = Reading(workers=1)
    iterators = {
        name: make_batch_iterator(info, "train", seq_len=64, batch_size=4, reading=reading)
        for name in ("a", "b")
    }
    mixture = MixedStream(iterators, {"a": 1.0, "b": 1.0}, 8)
    try:
        next(mixture)
        held = [value for batch in mixture._in_hand.values() for value in batch.values()]
        assert held and not any(in_shared_memory(value) for value in held)
    finally:
        mixture.close_readers()


def test_a_shard_that_cannot_be_read_names_it(tmp_path):
    """TensorFlow's reader opens a folder and fails only at its first read, with its own
    FailedPreconditionError (Grain's reader failed at the open, which was caught)."""
    folder = tmp_path / "train-00000-of-00001.tfrecord"
    folder.mkdir()
    with pytest.raises(DataError, match=rf"shard {folder} is corrupt.*Is a directory"):
        next(iter(TFRecordShard(str(folder), vocab_size=256, skip_corrupt=True)))
