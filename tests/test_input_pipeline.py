"""The data path: prepare -> ArrayRecord -> Grain chain -> packed batches -> device feed."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import documents, same, take
from skiplog import count_skipped

from input_pipeline.corpora import resolve_dataset
from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.device import DeviceFeed
from input_pipeline.errors import DataError
from input_pipeline.pipeline import make_batch_iterator
from input_pipeline.prepare import main as prepare_main
from input_pipeline.prepare import prepare_dataset
from input_pipeline.reading import Reading
from input_pipeline.records import sha256_of
from trainer.config import MeshConfig
from trainer.parallel import sharding


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "toy"
    prepare_dataset(
        documents(), out, eval_fraction=0.1, num_shards=3, max_record_tokens=512, progress=False
    )
    return load_dataset_info(out)


def test_prepare_writes_shards_counts_and_checksums(dataset):
    raw = json.loads((dataset.path / "dataset.json").read_text())
    train, held = raw["splits"]["train"], raw["splits"]["eval"]
    assert train["documents"] + held["documents"] == 60 and held["documents"] >= 1
    assert raw["vocab_size"] == 256 and raw["token_dtype"] == "|u1"
    assert len(train["shards"]) == 3
    total = sum(len(d.encode()) for d in documents())
    assert train["tokens"] + held["tokens"] == total  # nothing lost, long docs only cut
    for shard in train["shards"]:
        assert sha256_of(dataset.path / shard["file"]) == shard["sha256"]


def test_prepare_is_deterministic_and_refuses_to_overwrite(dataset, tmp_path):
    again = prepare_dataset(
        documents(),
        tmp_path / "again",
        eval_fraction=0.1,
        num_shards=3,
        max_record_tokens=512,
        progress=False,
    )
    a = json.loads((dataset.path / "dataset.json").read_text())
    b = json.loads((again / "dataset.json").read_text())
    assert a["splits"] == b["splits"]
    with pytest.raises(DataError, match="--overwrite"):
        prepare_dataset(documents(), again, progress=False)


def test_prepare_cli_reads_txt_and_jsonl(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world, a whole document")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n{"text": "two docs"}\n')
    out = tmp_path / "out"
    code = prepare_main(
        [
            "--input",
            str(tmp_path / "*.txt"),
            "--input",
            str(tmp_path / "*.jsonl"),
            "--output",
            str(out),
            "--eval-fraction",
            "0",
        ]
    )
    assert code == 0
    assert load_dataset_info(out).raw["splits"]["train"]["documents"] == 3
    assert prepare_main(["--input", str(tmp_path / "none*.txt"), "--output", str(out)]) == 2
    assert "matches no file" in capsys.readouterr().err


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_same_seed_same_batches_other_seed_differs(dataset, packing):
    kw = dict(seq_len=32, batch_size=4, packing=packing)
    a = take(make_batch_iterator(dataset, "train", reading=Reading(seed=1), **kw), 5)
    b = take(make_batch_iterator(dataset, "train", reading=Reading(seed=1), **kw), 5)
    c = take(make_batch_iterator(dataset, "train", reading=Reading(seed=2), **kw), 5)
    assert all(same(x, y) for x, y in zip(a, b, strict=True))
    assert not all(same(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_state_round_trip_gives_the_next_batch(dataset, packing, shuffle):
    kw = dict(seq_len=32, batch_size=4, packing=packing, reading=Reading(shuffle=shuffle, seed=3))
    it = make_batch_iterator(dataset, "train", **kw)
    take(it, 7)
    state = json.loads(json.dumps(it.get_state()))  # as stored in a checkpoint
    expected = take(it, 3)
    fresh = make_batch_iterator(dataset, "train", **kw)
    fresh.set_state(state)
    assert all(same(x, y) for x, y in zip(take(fresh, 3), expected, strict=True))


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_packing_invariants(dataset, packing):
    for batch in take(
        make_batch_iterator(dataset, "train", seq_len=48, batch_size=8, packing=packing), 10
    ):
        seg, pos, w = batch["segment_ids"], batch["positions"], batch["weights"]
        assert {k: v.shape for k, v in batch.items()} == {k: (8, 48) for k in batch}
        assert batch["weights"].dtype == np.float32 and seg.dtype == np.int32
        np.testing.assert_array_equal(w, (seg > 0).astype(np.float32))
        for row in range(8):
            s, p = seg[row], pos[row]
            real = s[s > 0]
            assert np.all(np.diff(real) >= 0) and np.all(s[len(real) :] == 0)  # padding at end
            for i in range(1, len(real)):
                # positions count up inside a segment and restart at 0 at a new one
                assert p[i] == (p[i - 1] + 1 if s[i] == s[i - 1] else 0)
            inside = (s[1:] == s[:-1]) & (s[1:] > 0)
            # each target is the next input within the same document piece
            np.testing.assert_array_equal(
                batch["targets"][row, :-1][inside], batch["inputs"][row, 1:][inside]
            )


def test_first_fit_keeps_documents_whole(dataset):
    batch = next(
        make_batch_iterator(
            dataset,
            "train",
            seq_len=512,
            batch_size=4,
            packing="first_fit",
            reading=Reading(shuffle=False),
        )
    )
    first = batch["inputs"][0][batch["segment_ids"][0] == 1]
    assert bytes(first.astype(np.uint8)[:4]) == b"doc "  # a row starts at a document start


def test_hosts_get_disjoint_data_that_covers_the_split(dataset):
    def records(index, count):
        it = make_batch_iterator(
            dataset,
            "train",
            seq_len=1024,
            batch_size=1,
            packing="first_fit",
            reading=Reading(shuffle=False, num_epochs=1, process_index=index, process_count=count),
        )
        seen = []
        for batch in it:
            for s in range(1, batch["segment_ids"].max() + 1):
                seen.append(batch["inputs"][0][batch["segment_ids"][0] == s].tobytes())
        return seen

    host0, host1, alone = records(0, 2), records(1, 2), records(0, 1)
    assert not set(host0) & set(host1)
    assert sorted(host0 + host1) == sorted(alone)


def test_eval_pads_the_last_batch_instead_of_dropping_it(dataset):
    batches = list(
        make_batch_iterator(
            dataset, "eval", seq_len=64, batch_size=8, reading=Reading(shuffle=False, num_epochs=1)
        )
    )
    counted = sum(b["weights"].sum() for b in batches)
    held = dataset.raw["splits"]["eval"]
    assert counted == held["tokens"] - held["records"]  # every next-token pair, once
    assert all(b["inputs"].shape == (8, 64) for b in batches)


def test_a_stream_without_records_is_one_line_naming_it(dataset):
    """More data streams than training records: the stream left without any says so, named as
    the unreadable-records line names it (the split, then the stream)."""
    records = dataset.num_records("train")
    reading = Reading(process_index=records, process_count=records + 1)
    said = (
        f"{dataset.path} train split (data stream {records} of {records + 1}) has no records; "
        "prepare more data or set a lower data.streams"
    )
    with pytest.raises(DataError, match=f"^{re.escape(said)}$"):
        make_batch_iterator(dataset, "train", seq_len=32, batch_size=8, reading=reading)


def test_device_feed_shards_batches_and_keeps_state(dataset):
    mesh = sharding.make_mesh(MeshConfig(data=4, fsdp=2, tensor=1))
    kw = dict(seq_len=32, batch_size=8, reading=Reading(seed=5))
    it = make_batch_iterator(dataset, "train", **kw)
    with DeviceFeed(it, sharding.batch_sharding(mesh), prefetch=3) as feed:
        global_batch, state = next(feed)
        second, _ = next(feed)
    assert global_batch["inputs"].shape == (8, 32)
    assert global_batch["inputs"].sharding.spec == sharding.batch_sharding(mesh).spec
    assert len(global_batch["inputs"].addressable_shards) == 8
    resumed = make_batch_iterator(dataset, "train", **kw)
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed)["inputs"], np.asarray(second["inputs"]))


def test_device_feed_reraises_host_errors():
    mesh = sharding.make_mesh(MeshConfig(data=-1))

    def broken():
        yield {"inputs": np.zeros((8, 4), np.int32)}
        raise DataError("shard x.arrayrecord is corrupt")

    with DeviceFeed(broken(), sharding.batch_sharding(mesh)) as feed:
        next(feed)
        with pytest.raises(DataError, match="corrupt"):
            next(feed)


def test_device_feed_closes_a_callers_grain_iterator():
    """A caller's Grain dataset (`trainer.run(data=..., eval_data=...)`) is iterated by the feed;
    closing the feed closes that iterator, its worker processes stopped in order, as it does
    our own pipeline's readers. Before: only our iterators' `close_readers` was called, so a
    caller's Grain iterator was left open (to the exit's finalizers)."""
    import grain

    mesh = sharding.make_mesh(MeshConfig(data=-1))
    rows = grain.MapDataset.range(100).map(lambda i: {"inputs": np.full((8, 4), i, np.int32)})
    it = iter(rows.to_iter_dataset())
    with DeviceFeed(it, sharding.batch_sharding(mesh)) as feed:
        next(feed)
    with pytest.raises(ValueError, match="closed"):
        next(it)


def test_device_feed_reraises_transfer_errors_in_order():
    """A batch the transfer stage cannot place (7 rows over 8 devices) surfaces in `next`, after
    the good batch before it, and the feed then stays failed."""
    mesh = sharding.make_mesh(MeshConfig(data=-1))
    batches = iter([{"inputs": np.zeros((8, 4), np.int32)}, {"inputs": np.zeros((7, 4), np.int32)}])
    with DeviceFeed(batches, sharding.batch_sharding(mesh)) as feed:
        first, _ = next(feed)
        assert first["inputs"].shape == (8, 4)
        for _ in range(2):
            with pytest.raises(ValueError):
                next(feed)


SIGNAL_DURING_A_WAIT = """
import signal, threading, time
from input_pipeline.device import DeviceFeed
from trainer.config import MeshConfig
from trainer.parallel import sharding

def never():  # a source whose next batch never comes (a dead mount)
    threading.Event().wait()
    yield

seen = []
signal.signal(signal.SIGTERM, lambda *_: (seen.append(1), time.sleep(0.3)))  # outlasts a poll
feed = DeviceFeed(never(), sharding.batch_sharding(sharding.make_mesh(MeshConfig(data=-1))))
main = threading.main_thread().ident
threading.Timer(0.05, signal.pthread_kill, (main, signal.SIGTERM)).start()
assert feed.next_unless(lambda: bool(seen)) is None
print("the wait ended")
"""


def test_a_signal_handled_during_a_wait_for_a_batch_ends_the_wait(repo_root):
    """A SIGTERM whose handling outlasts the feed's 0.1 s poll, while the source never delivers:
    the feed's queue was a `queue.SimpleQueue`, whose `get(timeout)` in CPython 3.11 and 3.12
    then waits forever (a negative time left means no timeout), so a stopped run hung in its
    wait for data, about 2% of runs under load. In a child: the old wait never ends."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", SIGNAL_DURING_A_WAIT],
            cwd=repo_root,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the wait for a batch never ended after the signal was handled")
    assert done.returncode == 0 and "the wait ended" in done.stdout, done.stderr[-2000:]


def test_bad_dataset_paths_name_the_fix(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        resolve_dataset(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="input_pipeline.prepare"):
        load_dataset_info(resolve_dataset(str(tmp_path / "empty")))


def test_missing_shard_is_reported(dataset, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dataset.path, copy)
    next(copy.glob("train-00001-*")).unlink()
    with pytest.raises(DataError, match="train-00001.* is missing"):
        make_batch_iterator(load_dataset_info(copy), "train", seq_len=8, batch_size=2)


def corrupt_copy(dataset, tmp_path, truncate=False):
    import shutil

    copy = tmp_path / "corrupt"
    shutil.copytree(dataset.path, copy)
    shard = sorted(copy.glob("train-00000-*"))[0]
    data = bytearray(shard.read_bytes())
    if truncate:
        data = data[: len(data) // 2]
    else:
        for i in range(200, len(data) // 2):
            data[i] ^= 0x5A
    shard.write_bytes(bytes(data))
    return load_dataset_info(copy), shard


@pytest.mark.parametrize("truncate", [False, True])
def test_corrupt_or_truncated_shard_names_the_file(dataset, tmp_path, truncate):
    info, shard = corrupt_copy(dataset, tmp_path, truncate)
    with pytest.raises(DataError, match=rf"shard .*{shard.name} is corrupt or truncated"):
        it = make_batch_iterator(
            info, "train", seq_len=32, batch_size=4, reading=Reading(shuffle=False)
        )
        take(it, 30)


def test_skip_corrupt_keeps_training_on_the_readable_records(dataset, tmp_path):
    info, _ = corrupt_copy(dataset, tmp_path)
    it = make_batch_iterator(
        info, "train", seq_len=32, batch_size=4, reading=Reading(shuffle=False, skip_corrupt=True)
    )
    assert all(b["weights"].sum() > 0 for b in take(it, 30))


def test_bench_cli_reports_pipeline_and_raw_rates(dataset, capsys, repo_root):
    from benchmarks.input_rate import main as bench_main

    code = bench_main(
        ["--config", "configs/tiny.yaml", "--batches", "3", f"data.path={dataset.path}"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "tokens/s" in out and "first batch" in out and "raw ArrayRecord reads" in out


def edited_copy(dataset, tmp_path, edit):
    """A copy of the dataset whose dataset.json went through `edit(raw) -> raw`."""
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(dataset.path, copy)
    raw = json.loads((copy / "dataset.json").read_text())
    (copy / "dataset.json").write_text(json.dumps(edit(raw)))
    return copy


def without(raw, *keys):
    *parents, last = keys
    node = raw
    for key in parents:
        node = node[key]
    del node[last]
    return raw


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda raw: without(raw, "vocab_size"), "vocab_size is missing, not a whole number"),
        (lambda raw: [raw], "the top level is .*, not a JSON object"),
        (lambda raw: without(raw, "splits", "train"), "splits.train is missing"),
        (lambda raw: {**raw, "token_dtype": "float32"}, 'token_dtype is "float32", not a \\|u1'),
        (
            lambda raw: without(raw, "splits", "eval", "shards", 0, "file"),
            r"splits.eval.shards\[0\].file is missing",
        ),
        (lambda raw: {**raw, "tokenizer": "byte"}, 'tokenizer is "byte", not a JSON object'),
        (lambda raw: {**raw, "null_texts_skipped": "3"}, 'null_texts_skipped is "3", not a who'),
    ],
)
def test_damaged_dataset_json_names_the_field(dataset, tmp_path, edit, message):
    """Before: a KeyError or AttributeError traceback, or (no train split) a fix about evals."""
    copy = edited_copy(dataset, tmp_path, edit)
    with pytest.raises(DataError, match=f"dataset.json: {message}.*prepare --overwrite"):
        load_dataset_info(copy)


def test_an_eval_split_without_records_is_refused_when_loaded(dataset, tmp_path):
    """Before: the run trained, then failed at its first eval."""

    def empty_eval(raw):
        raw["splits"]["eval"].update(records=0, tokens=0, shards=[])
        return raw

    with pytest.raises(DataError, match="eval split without tokens"):
        load_dataset_info(edited_copy(dataset, tmp_path, empty_eval))


def test_skip_corrupt_with_every_shard_unreadable_is_an_error(dataset, tmp_path):
    """Before: the reader skipped every record forever and the run hung without a word."""
    import shutil

    copy = tmp_path / "all_truncated"
    shutil.copytree(dataset.path, copy)
    for shard in copy.glob("train-*"):
        shard.write_bytes(shard.read_bytes()[:100])
    reading = Reading(skip_corrupt=True)
    with pytest.raises(DataError, match="all 3 shards of .* are corrupt or truncated"):
        make_batch_iterator(
            load_dataset_info(copy), "train", seq_len=8, batch_size=2, reading=reading
        )


def test_skipped_records_are_said_once_per_shard(dataset, tmp_path, capfd):
    """Before: with data.verify_checksums=false nothing but a metrics field told of the skips."""
    info, shard = corrupt_copy(dataset, tmp_path, truncate=True)
    log = tmp_path / "skipped.jsonl"
    reading = Reading(shuffle=False, num_epochs=3, skip_corrupt=True, skip_log=log)
    list(make_batch_iterator(info, "train", seq_len=32, batch_size=4, reading=reading))
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"records of shard {shard}" in warnings[0]
    assert str(log) in warnings[0] and "corrupt_records_skipped" in warnings[0]


def test_eval_with_more_streams_than_records_counts_every_token(dataset):
    """Before: a stream without eval records failed the first eval, after training."""
    from trainer.config import load_config
    from trainer.data import dataset_sources

    records = dataset.num_records("eval")
    pairs = dataset.num_tokens("eval") - records
    for streams in (1, 2 * records):
        overrides = [f"data.path={dataset.path}", f"data.streams={streams}", "data.seq_len=32"]
        config = load_config(None, [*overrides, f"data.global_batch_size={2 * records}"])
        batches = dataset_sources(config.data, seed=0).make_eval()
        assert sum(float(b["weights"].sum()) for b in take(batches, 60)) == pairs


def test_a_data_path_that_is_a_file_names_its_folder(dataset):
    """Before: 'not a prepared dataset (no dataset.json)' for the dataset.json file itself."""
    with pytest.raises(DataError, match=f"data.path=.*dataset.json is a file; .*{dataset.path}"):
        resolve_dataset(str(dataset.path / "dataset.json"))


def unreadable_records_copy(dataset, tmp_path):
    """A copy whose train shards keep a readable index but no readable record: each shard's
    bytes garbled from its header up to as close to its index as still opens."""
    import shutil

    from conftest import garble_records

    copy = tmp_path / "unreadable_records"
    shutil.copytree(dataset.path, copy)
    for shard in copy.glob("train-*"):
        garble_records(shard)
    return load_dataset_info(copy)


@pytest.mark.parametrize("shuffle", [True, False])
def test_skip_corrupt_with_no_readable_record_is_an_error(dataset, tmp_path, shuffle):
    """Before: with every record unreadable but the shard indexes readable, the reader skipped
    every record of every epoch forever and the run hung."""
    from input_pipeline.pipeline import memory_source, split_source

    info = unreadable_records_copy(dataset, tmp_path)
    reading = Reading(shuffle=shuffle, skip_corrupt=True)
    source = split_source(info, "train", reading)
    assert all(record is None for record in source.read_many(range(len(source))))
    said = f"none of the {len(source)} records of .*train split .* is readable: data.skip_c"
    for cached in (None, memory_source(info, "train", reading)):
        it = make_batch_iterator(
            info, "train", seq_len=8, batch_size=2, reading=reading, source=cached
        )
        with pytest.raises(DataError, match=f"{said}.*prepare --overwrite"):
            next(it)


def test_memory_cache_lists_skipped_records_before_the_workdir_exists(dataset, tmp_path):
    """Before: data.cache=memory reads every shard before the run makes its workdir, and the
    first skipped record was a FileNotFoundError traceback."""
    from input_pipeline.pipeline import memory_source

    info, _ = corrupt_copy(dataset, tmp_path)
    log = tmp_path / "workdir" / "skipped.jsonl"
    source = memory_source(info, "train", Reading(skip_corrupt=True, skip_log=log))
    assert count_skipped(log) == len(source.missing) > 0


@pytest.mark.parametrize("shuffle", [True, False])
def test_skip_log_lists_each_bad_record_once_however_many_epochs(dataset, tmp_path, shuffle):
    """Before: every epoch appended the same skipped records again, so a long run over a small
    dataset grew the skip log (re-read at every metrics line) without bound."""
    info, _ = corrupt_copy(dataset, tmp_path)
    counts = {}
    for epochs in (1, 4):
        log = tmp_path / f"skipped-{epochs}.jsonl"
        reading = Reading(shuffle=shuffle, num_epochs=epochs, skip_corrupt=True, skip_log=log)
        list(make_batch_iterator(info, "train", seq_len=32, batch_size=4, reading=reading))
        lines = log.read_text().splitlines()
        assert len(lines) == len(set(lines)) == count_skipped(log)
        counts[epochs] = count_skipped(log)
    assert counts[4] == counts[1] > 0
