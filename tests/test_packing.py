"""The batch-at-a-time concat packer: the contract, equivalence to Grain's ConcatThenSplit chain
it replaced, and exact resume, on records read from a real prepared dataset."""

import json
import pickle

import grain
import numpy as np
import pytest
from conftest import take

from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.packing import ConcatPackIterDataset
from input_pipeline.pipeline import FEATURES, ReadRecords, make_batch_iterator, padded_batches
from input_pipeline.positions import DamagedPositionError
from input_pipeline.prepare import prepare_dataset
from input_pipeline.reading import Reading
from input_pipeline.records import CheckedSource, DecodeRecord
from trainer.config import load_config
from trainer.errors import ConfigError

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
    """The concat branch before this packer: ConcatThenSplit -> padded batch -> contract."""
    rows = grain.experimental.ConcatThenSplitIterDataset(
        grain.MapDataset.source(records).to_iter_dataset(),
        length_struct={name: seq_len for name in FEATURES},
    )
    return list(padded_batches(rows, batch_size))


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


@pytest.mark.parametrize(("field", "past"), [("record", 4), ("offset", 10**6)])
def test_a_saved_record_or_offset_past_its_read_is_damage(records, field, past):
    """Before: the packer moved on to the next record or read in silence."""
    elements = in_reads(records, 4)
    it = packed(elements, 50, 3)
    next(it)
    state = {**it.get_state(), field: past}
    with pytest.raises(DamagedPositionError, match=f"the concat packer's {field} is {past}, not"):
        packed(elements, 50, 3).set_state(state)


def test_a_record_with_no_pairs_resumes_at_its_offset_0():
    """A batch that ends with its record leaves the next one at offset 0, pairs or none."""
    pairs = [16, 0, 20]  # the first fills one batch of 2 rows of 8 exactly
    element = [{"inputs": np.arange(n), "targets": np.arange(n) + 1} for n in pairs]
    it = packed([element], 8, 2)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert (state["record"], state["offset"]) == (1, 0)
    fresh = packed([element], 8, 2)
    fresh.set_state(state)
    assert_same(next(fresh), next(it))


def resumed_batches(dataset, **kw) -> list[dict]:
    """5 batches read after restoring the state saved at batch 37 (past the first epoch, over
    threaded reads), each checked equal to the uninterrupted read's."""
    kw["reading"] = Reading(seed=11, read_threads=3)
    it = make_batch_iterator(dataset, "train", **kw)
    for _ in range(37):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(5)]
    fresh = make_batch_iterator(dataset, "train", **kw)
    fresh.set_state(state)
    resumed = [next(fresh) for _ in range(5)]
    for a, b in zip(resumed, expected, strict=True):
        assert_same(a, b)
    return resumed


def test_pipeline_resumes_exactly_over_threaded_reads_and_epochs(dataset):
    resumed_batches(dataset, seq_len=64, batch_size=4)


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


# --------------------------------------------------------------------------- documents per row


def reference_batches(records, seq_len, batch_size, max_docs):
    """A token-at-a-time packer to check against: concat packing, where a row whose latest
    document ended mid-row holding `max_docs` pieces is padded to its end."""
    rows, row, pieces = [], [], 0

    def close_row():
        nonlocal row, pieces
        rows.append(row + [(0, 0, 0, 0)] * (seq_len - len(row)))
        row, pieces = [], 0

    for record in records:
        count = len(record["inputs"])
        for i in range(count):
            if len(row) == seq_len:
                close_row()
            if i == 0 or not row:  # a piece begins: a document start, or a row start
                pieces += 1
                start = len(row)
            token = (int(record["inputs"][i]), int(record["targets"][i]), pieces, len(row) - start)
            row.append(token)
        if count and pieces >= max_docs and 0 < len(row) < seq_len:
            close_row()
    if row:
        close_row()
    rows += [[(0, 0, 0, 0)] * seq_len] * (-len(rows) % batch_size)
    table = np.array(rows, np.int32).reshape(-1, batch_size, seq_len, 4)
    return [
        {
            "inputs": b[..., 0],
            "targets": b[..., 1],
            "segment_ids": b[..., 2],
            "positions": b[..., 3],
            "weights": (b[..., 2] > 0).astype(np.float32),
        }
        for b in table
    ]


def bounded(elements, seq_len, batch_size, max_docs):
    parent = grain.MapDataset.source(elements).to_iter_dataset()
    dataset = ConcatPackIterDataset(
        parent, seq_len=seq_len, batch_size=batch_size, max_docs_per_row=max_docs
    )
    return iter(dataset)


@pytest.mark.parametrize("max_docs", [1, 2, 3, 7])
@pytest.mark.parametrize("seq_len,batch_size", [(50, 4), (300, 2), (7, 5)])
@pytest.mark.parametrize("read_size", [1, 6])
def test_bounded_rows_equal_a_token_at_a_time_reference(
    records, max_docs, seq_len, batch_size, read_size
):
    """Every pair once, in order; at most `max_docs` pieces per row; the rest of a row that
    reaches the bound is padding and the next document starts the next row."""
    elements = records if read_size == 1 else in_reads(records, read_size)
    new = list(bounded(elements, seq_len, batch_size, max_docs))
    want = reference_batches(records, seq_len, batch_size, max_docs)
    assert len(new) == len(want) > 1
    for a, b in zip(new, want, strict=True):
        assert_same(a, b)
        assert_rows_well_formed(a, max_docs)


def test_a_bound_never_reached_changes_nothing(records):
    """The test data holds at most a dozen pieces per 300-token row: a bound above that gives
    the unbounded batches, a bound below it does not."""
    most = max(int(b["segment_ids"].max()) for b in packed(records, 300, 2))
    assert 2 < most < 40
    for a, b in zip(bounded(records, 300, 2, most), packed(records, 300, 2), strict=True):
        assert_same(a, b)
    assert len(list(bounded(records, 300, 2, most - 1))) >= len(list(packed(records, 300, 2)))
    assert any(
        not np.array_equal(a["inputs"], b["inputs"])
        for a, b in zip(bounded(records, 300, 2, 2), packed(records, 300, 2), strict=False)
    )


@pytest.mark.parametrize("taken", [0, 1, 5, 11])
def test_bounded_state_restores_the_next_batch_exactly(records, taken):
    elements = in_reads(records, 4)
    it = bounded(elements, 50, 3, 2)
    for _ in range(taken):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = list(it)
    fresh = bounded(elements, 50, 3, 2)
    fresh.set_state(state)
    resumed = list(fresh)
    assert len(resumed) == len(expected) > 0
    for a, b in zip(resumed, expected, strict=True):
        assert_same(a, b)


def assert_rows_well_formed(batch, bound):
    """What the packed-document kernel's offsets are derived from: in each row, documents
    1..k (k <= bound) one after another from column 0, positions counting from 0 in each,
    then padding (segment 0, weight 0, position 0) to the row's end."""
    for segments, positions in zip(batch["segment_ids"], batch["positions"], strict=True):
        used = int((segments > 0).sum())
        assert not segments[used:].any() and not positions[used:].any()
        docs, where = segments[:used], positions[:used]
        if used:
            assert docs[0] == 1 and where[0] == 0 and docs[-1] <= bound
            step = np.diff(docs)
            assert set(step.tolist()) <= {0, 1}
            np.testing.assert_array_equal(where[1:][step == 1], 0)
            np.testing.assert_array_equal(np.diff(where)[step == 0], 1)
    np.testing.assert_array_equal(batch["weights"], batch["segment_ids"] > 0)


def pieces_of(batches):
    """The inputs of every segment of every row (padding left out), as bytes."""
    found = []
    for batch in batches:
        for inputs, segments in zip(batch["inputs"], batch["segment_ids"], strict=True):
            found += [bytes(inputs[segments == s].astype(np.uint8)) for s in set(segments) - {0}]
    return found


def test_first_fit_rows_hold_at_most_the_bound_and_every_piece(dataset):
    """first_fit packs whole pieces (records cut to rows): the bound keeps each of them, once."""
    kw = dict(seq_len=128, batch_size=4, packing="first_fit")

    def batches(bound):
        reading = Reading(shuffle=False, num_epochs=1)
        return list(
            make_batch_iterator(dataset, "train", reading=reading, max_docs_per_row=bound, **kw)
        )

    free, capped = batches(None), batches(2)
    for batch in capped:
        assert_rows_well_formed(batch, 2)
    assert max(int(b["segment_ids"].max()) for b in free) > 2  # the bound binds
    assert max(int(b["segment_ids"].max()) for b in capped) == 2
    assert sorted(pieces_of(capped)) == sorted(pieces_of(free))
    real = sum(float(b["weights"].sum()) for b in capped)
    assert (
        real
        == sum(float(b["weights"].sum()) for b in free)
        == dataset.split("train")["tokens"] - dataset.num_records("train")
    )


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_pipeline_resumes_exactly_with_the_bound(dataset, packing):
    for batch in resumed_batches(
        dataset, seq_len=64, batch_size=4, packing=packing, max_docs_per_row=2
    ):
        assert_rows_well_formed(batch, 2)


# --------------------------------------------------------------------------- per-epoch offset

WINDOW = 32  # seq_len of the fixed-window corpus


@pytest.fixture(scope="module")
def whole_rows(tmp_path_factory):
    """Documents of exactly WINDOW pairs: unshifted concat packing makes each document one row,
    so every epoch cuts the same windows, whatever the shuffle."""
    rng = np.random.default_rng(3)
    docs = ["".join(rng.choice(list("abcdefghij"), size=WINDOW + 1)) for _ in range(40)]
    out = tmp_path_factory.mktemp("windows") / "ds"
    prepare_dataset(docs, out, eval_fraction=0.0, num_shards=2, progress=False)
    return load_dataset_info(out)


def row_windows(info, offset, seed=0, rows=40):
    """The rows of the first `rows` batches of one row each, as bytes."""
    it = make_batch_iterator(
        info,
        "train",
        seq_len=WINDOW,
        batch_size=1,
        reading=Reading(seed=seed, read_threads=1),
        concat_offset=offset,
    )
    return [bytes(next(it)["inputs"][0].astype(np.uint8)) for _ in range(rows)]


def test_random_offset_cuts_new_windows_every_epoch(whole_rows):
    """Issue 29: nanoGPT samples windows anywhere; fixed cuts show the model the same 40
    windows each epoch. With the offset, epochs share (almost) no window."""
    epochs = [row_windows(whole_rows, "none", rows=120)[i : i + 40] for i in (0, 40, 80)]
    assert epochs[0] != epochs[1] and set(epochs[0]) == set(epochs[1]) == set(epochs[2])
    shifted = row_windows(whole_rows, "random_per_epoch", rows=120)
    first, second, third = set(shifted[:39]), set(shifted[41:80]), set(shifted[81:120])
    assert not first & set(epochs[0])  # even the first epoch starts at an offset
    assert len(first & second) <= 2 and len(second & third) <= 2
    assert shifted == row_windows(whole_rows, "random_per_epoch", rows=120)  # seeded
    assert shifted != row_windows(whole_rows, "random_per_epoch", seed=1, rows=120)


def test_random_offset_shortens_only_each_epochs_first_record(dataset):
    split = dataset.split("train")
    source = CheckedSource(dataset.shard_paths("train"), [s["records"] for s in split["shards"]])

    def stream(shift, seed=3):
        reads = ReadRecords(
            source,
            dtype=dataset.token_dtype,
            host_index=0,
            host_count=1,
            shuffle=True,
            seed=seed,
            num_epochs=3,
            per_read=7,
            epoch_shift=shift,
        )
        return [r for i in range(reads.num_reads) for r in reads.map(i)], reads.host_records

    plain, n = stream(0)
    shifted, _ = stream(64)
    cuts = []
    for i, (a, b) in enumerate(zip(plain, shifted, strict=True)):
        cut = len(a["inputs"]) - len(b["inputs"])
        for name in FEATURES:
            np.testing.assert_array_equal(a[name][cut:], b[name])
        assert 0 <= cut < 64 if i % n == 0 else cut == 0
        cuts.append(cut)
    assert len({cuts[e * n] for e in range(3)}) > 1  # a new offset each epoch
    assert stream(64)[0][0]["inputs"].tobytes() == shifted[0]["inputs"].tobytes()
    other = [len(r["inputs"]) for r in stream(64, seed=4)[0]]
    assert other != [len(r["inputs"]) for r in stream(0, seed=4)[0]]


@pytest.mark.parametrize("stop", [0, 40, 85, 86, 87, 150])
@pytest.mark.parametrize("bound", [None, 2])
def test_offset_pipeline_stopped_and_resumed_equals_one_read(dataset, stop, bound):
    """Read 180 batches (about two epochs) in one go, or stop after `stop` (around the first
    epoch's end, too), checkpoint the state, and go on in a fresh iterator: the same batches."""
    kw = dict(seq_len=64, batch_size=4, concat_offset="random_per_epoch", max_docs_per_row=bound)
    kw["reading"] = Reading(seed=5, read_threads=3)
    whole = take(make_batch_iterator(dataset, "train", **kw), 180)
    first = make_batch_iterator(dataset, "train", **kw)
    head = take(first, stop)
    state = json.loads(json.dumps(first.get_state()))
    fresh = make_batch_iterator(dataset, "train", **kw)
    fresh.set_state(state)
    for a, b in zip(head + take(fresh, 180 - stop), whole, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_either_packer_refuses_rows_it_cannot_make(dataset, packing):
    """One check of the rows' shape for both packers (`check_rows`), before anything is read."""
    kw = dict(seq_len=64, batch_size=4, packing=packing)
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        make_batch_iterator(dataset, "train", **{**kw, "batch_size": 0})
    with pytest.raises(ValueError, match="max_docs_per_row=0 must be >= 1"):
        make_batch_iterator(dataset, "train", **kw, max_docs_per_row=0)


def test_offset_needs_concat_packing_of_arrayrecord(dataset):
    with pytest.raises(DataError, match="data.concat_offset=random_per_epoch needs data.packing"):
        make_batch_iterator(
            dataset,
            "train",
            seq_len=64,
            batch_size=4,
            packing="first_fit",
            concat_offset="random_per_epoch",
        )
    with pytest.raises(ConfigError, match="use data.packing=concat or data.concat_offset=none"):
        load_config(None, ["data.packing=first_fit", "data.concat_offset=random_per_epoch"])
    with pytest.raises(ConfigError, match="data.max_docs_per_row=0 is not a document count"):
        load_config(None, ["data.max_docs_per_row=0"])


def test_the_trainer_reads_with_the_configured_bound_and_offset(dataset):
    """`dataset_sources` bounds train and eval rows; the offset moves train rows only (evals
    compare the same windows every time)."""
    from trainer.data import dataset_sources

    def batches(split, *keys):
        keys = [f"data.path={dataset.path}", "data.seq_len=48", "data.global_batch_size=8", *keys]
        sources = dataset_sources(load_config(None, keys).data, seed=0)
        return take(iter(sources.train if split == "train" else sources.make_eval()), 3)

    plain = batches("train", "data.max_docs_per_row=1")
    moved = batches("train", "data.max_docs_per_row=1", "data.concat_offset=random_per_epoch")
    assert all(b["segment_ids"].max() == 1 for b in plain + moved)
    assert not np.array_equal(plain[0]["inputs"], moved[0]["inputs"])
    evals = batches("eval", "data.max_docs_per_row=1", "data.concat_offset=random_per_epoch")
    for a, b in zip(evals, batches("eval", "data.max_docs_per_row=1"), strict=True):
        assert_same(a, b)
        assert a["segment_ids"].max() == 1
    assert max(int(b["segment_ids"].max()) for b in batches("eval")) > 1  # auto: 5 documents


@pytest.mark.parametrize("seq_len,bound", [(48, 5), (256, 8), (1024, 20), (2048, 36)])
def test_auto_bound_grows_with_seq_len_and_a_number_wins(seq_len, bound):
    auto = load_config(None, [f"data.seq_len={seq_len}"]).data
    assert auto.max_docs_per_row == "auto" and auto.resolved_max_docs_per_row == bound
    fixed = load_config(None, [f"data.seq_len={seq_len}", "data.max_docs_per_row=3"]).data
    assert fixed.resolved_max_docs_per_row == 3
