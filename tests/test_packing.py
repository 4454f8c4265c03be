"""The batch-at-a-time concat packer: the contract, equivalence to Grain's ConcatThenSplit chain
it replaced, and exact resume, on records read from a real prepared dataset."""

import json
import pickle

import grain
import numpy as np
import pytest

from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.packing import ConcatPackIterDataset
from input_pipeline.pipeline import (
    FEATURES,
    PadBatch,
    ReadRecords,
    ToBatchContract,
    make_batch_iterator,
)
from input_pipeline.prepare import prepare_dataset
from input_pipeline.reading import Reading
from input_pipeline.records import CheckedSource, DecodeRecord

FIELDS = ("inputs", "targets", "segment_ids", "positions", "weights")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Documents from 2 to ~900 bytes; records cut at 300 tokens, so some rows hold a dozen
    documents and some documents span rows."""
    rng = np.random.default_rng(7)
    docs = [
        f"{i}:" + "".join(rng.choice(list("abcdefgh \n"), size=int(rng.integers(0, 900))))
        for i in range(80)
    ]
    out = tmp_path_factory.mktemp("packing") / "ds"
    prepare_dataset(
        docs, out, eval_fraction=0.1, num_shards=3, max_record_tokens=300, progress=False
    )
    return load_dataset_info(out)


@pytest.fixture(scope="module")
def records(dataset):
    """Every train record, decoded, in a fixed shuffled order."""
    split = dataset.split("train")
    source = CheckedSource(dataset.shard_paths("train"), [s["records"] for s in split["shards"]])
    decode = DecodeRecord(dataset.token_dtype)
    order = np.random.default_rng(0).permutation(len(source))
    return [decode.map(source[int(i)]) for i in order]


def old_chain(records, seq_len, batch_size):
    """The concat branch before this packer: ConcatThenSplit -> contract -> batch -> pad."""
    rows = grain.experimental.ConcatThenSplitIterDataset(
        grain.MapDataset.source(records).to_iter_dataset(),
        length_struct={name: seq_len for name in FEATURES},
    )
    batches = rows.map(ToBatchContract()).batch(batch_size, drop_remainder=False)
    return list(batches.map(PadBatch(batch_size)))


def packed(elements, seq_len, batch_size):
    parent = grain.MapDataset.source(elements).to_iter_dataset()
    return iter(ConcatPackIterDataset(parent, seq_len=seq_len, batch_size=batch_size))


def in_reads(records, size):
    return [records[i : i + size] for i in range(0, len(records), size)]


def assert_same(a, b):
    assert a.keys() == b.keys() == set(FIELDS)
    for name in FIELDS:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("seq_len,batch_size", [(64, 4), (300, 2), (7, 5), (1024, 3)])
@pytest.mark.parametrize("read_size", [1, 6])
def test_batches_equal_the_concat_then_split_chain(records, seq_len, batch_size, read_size):
    """Same tokens in the same order, same segment ids, positions, weights and final padding;
    records handed over one at a time or in reads of several."""
    elements = records if read_size == 1 else in_reads(records, read_size)
    new = list(packed(elements, seq_len, batch_size))
    old = old_chain(records, seq_len, batch_size)
    assert len(new) == len(old) > 1
    for a, b in zip(new, old, strict=True):
        assert_same(a, b)


def test_batch_contract_and_tokens_are_the_records_concatenated(records):
    seq_len, batch_size = 48, 6
    batches = list(packed(in_reads(records, 5), seq_len, batch_size))
    for batch in batches:
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
            k: ((batch_size, seq_len), np.float32 if k == "weights" else np.int32) for k in FIELDS
        }
        np.testing.assert_array_equal(batch["weights"], (batch["segment_ids"] > 0))
    real = np.concatenate([b["weights"].reshape(-1) > 0 for b in batches])
    assert not np.any(real[real.sum() :])  # padding only after the last pair
    flat = {k: np.concatenate([b[k].reshape(-1) for b in batches])[: real.sum()] for k in FIELDS}
    for name in FEATURES:  # every pair once, in order
        np.testing.assert_array_equal(flat[name], np.concatenate([r[name] for r in records]))
    # a piece starts at each document start and at each row start; ids count from 1 per row
    doc_start = np.zeros(real.sum(), bool)
    doc_start[np.cumsum([0] + [len(r["inputs"]) for r in records[:-1]])] = True
    column = np.arange(real.sum()) % seq_len
    piece_start = doc_start | (column == 0)
    seg, in_row = flat["segment_ids"], column[1:] > 0
    step = seg[1:] - seg[:-1]
    np.testing.assert_array_equal(step[in_row], piece_start[1:][in_row])  # +1 at a new piece
    np.testing.assert_array_equal(seg[column == 0], 1)
    last_start = np.maximum.accumulate(np.where(piece_start, np.arange(real.sum()), 0))
    np.testing.assert_array_equal(flat["positions"], np.arange(real.sum()) - last_start)


def test_narrow_views_and_int32_records_pack_alike(records):
    wide = [{k: v.astype(np.int32) for k, v in r.items()} for r in records]
    assert records[0]["inputs"].dtype == np.uint8  # what DecodeRecord hands over (byte tokens)
    for a, b in zip(packed(records, 40, 3), packed(wide, 40, 3), strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("taken", [0, 1, 3, 8])
def test_state_restores_the_next_batch_exactly(records, taken):
    """Save after k batches (mid-read, mid-record), restore into a fresh iterator: the same
    next batches, through the end of the data."""
    elements = in_reads(records, 4)
    it = packed(elements, 50, 3)
    for _ in range(taken):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
    expected = list(it)
    fresh = packed(elements, 50, 3)
    fresh.set_state(state)
    resumed = list(fresh)
    assert len(resumed) == len(expected) > 0
    for a, b in zip(resumed, expected, strict=True):
        assert_same(a, b)


def test_state_at_the_end_of_the_data_stays_at_the_end(records):
    it = packed(records[:5], 32, 2)
    list(it)
    fresh = packed(records[:5], 32, 2)
    fresh.set_state(json.loads(json.dumps(it.get_state())))
    with pytest.raises(StopIteration):
        next(fresh)


def test_pipeline_resumes_exactly_over_threaded_reads_and_epochs(dataset):
    kw = dict(seq_len=64, batch_size=4, reading=Reading(seed=11, read_threads=3))
    it = make_batch_iterator(dataset, "train", **kw)
    for _ in range(37):  # past the first epoch (~2k pairs of ~22k per epoch... many reads)
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(5)]
    fresh = make_batch_iterator(dataset, "train", **kw)
    fresh.set_state(state)
    for a, b in zip([next(fresh) for _ in range(5)], expected, strict=True):
        assert_same(a, b)


def test_unshuffled_pipeline_equals_the_old_chain_on_the_same_records(dataset):
    split = dataset.split("train")
    source = CheckedSource(dataset.shard_paths("train"), [s["records"] for s in split["shards"]])
    decode = DecodeRecord(dataset.token_dtype)
    in_order = [decode.map(source[i]) for i in range(len(source))]
    new = list(
        make_batch_iterator(
            dataset, "train", seq_len=96, batch_size=5, reading=Reading(shuffle=False, num_epochs=1)
        )
    )
    old = old_chain(in_order, 96, 5)
    assert len(new) == len(old)
    for a, b in zip(new, old, strict=True):
        assert_same(a, b)


def test_reads_shuffle_every_epoch_and_split_hosts(dataset):
    split = dataset.split("train")
    source = CheckedSource(dataset.shard_paths("train"), [s["records"] for s in split["shards"]])
    n = len(source)

    def order(host, hosts, seed=3):
        reads = ReadRecords(
            source,
            dtype=dataset.token_dtype,
            host_index=host,
            host_count=hosts,
            shuffle=True,
            seed=seed,
            num_epochs=2,
            per_read=7,
        )
        got = [bytes(r["inputs"]) for i in range(reads.num_reads) for r in reads.map(i)]
        assert len(got) == 2 * reads.host_records
        return got[: reads.host_records], got[reads.host_records :]

    first, second = order(0, 1)
    assert sorted(first) == sorted(second) and first != second  # a new order every epoch
    assert order(0, 1) == (first, second)  # seeded
    assert order(0, 1, seed=4)[0] != first
    host0, host1 = order(0, 2)[0], order(1, 2)[0]
    assert len(host0) + len(host1) == n
    assert sorted(host0 + host1) == sorted(first)  # disjoint, and together the whole split


def test_batched_reads_match_record_reads_and_survive_pickling(dataset):
    split = dataset.split("train")
    source = CheckedSource(dataset.shard_paths("train"), [s["records"] for s in split["shards"]])
    keys = np.random.default_rng(1).permutation(len(source))[:40].tolist()
    expected = [source[k] for k in keys]
    assert source.read_many(keys) == expected  # in the asked order, across shards
    assert pickle.loads(pickle.dumps(source)).read_many(keys) == expected  # worker processes
