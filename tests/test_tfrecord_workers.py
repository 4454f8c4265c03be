"""data.skip_corrupt with Grain workers and no shuffle over TFRecord data: a worker whose shards
are all unreadable ends its reads while other shards are readable, as with ArrayRecord data.

Grain gives worker i of W the i-th, (i+W)-th, ... shard of the repeated shard list, so with 4
shards and 2 workers, worker 0 reads shards 0 and 2 and worker 1 shards 1 and 3, every epoch."""

import shutil
from pathlib import Path

import numpy as np
import pytest
from skiplog import count_skipped
from test_skip_hang import train, train_alone_in_this_process
from test_tfrecord import garbled_copy

from input_pipeline.dataset_info import load_dataset_info
from input_pipeline.errors import DataError
from input_pipeline.records import SkipLog
from input_pipeline.shares import ShareUnreadable
from input_pipeline.tfrecords import EmptyShards, TFRecordShard

SHARDS = 4


@pytest.fixture(scope="module")
def four_shards(tmp_path_factory) -> Path:
    """4 TFRecord train shards of 2 records (4096 byte tokens each), no eval split."""
    from input_pipeline.prepare import prepare_dataset

    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghij klmnopqrst\nuvwxyz", np.uint8)
    texts = [rng.choice(letters, 4096).tobytes().decode() for _ in range(2 * SHARDS)]
    out = tmp_path_factory.mktemp("data") / "four-shards"
    kw = dict(eval_fraction=0, num_shards=SHARDS, max_record_tokens=4096, progress=False)
    return prepare_dataset(texts, out, format="tfrecord", **kw)


def test_a_workers_share_is_exactly_the_shards_grain_gives_it():
    """Before: EmptyShards did not know a worker's shards and guessed from rounds of reads."""
    paths = ["a", "b", "c", "d"]
    halves = EmptyShards(paths, in_order=True, workers=2)
    assert halves.share == 2 and halves.share_of("c") == ["a", "c"] == halves.share_of("a")
    assert halves.share_of("d") == ["b", "d"]
    assert EmptyShards(paths, in_order=True, workers=3).share == 4  # gcd(3, 4) = 1: every shard
    assert EmptyShards(paths, in_order=False, workers=2).share == 4  # shuffled: every shard
    assert EmptyShards(paths, in_order=True, workers=0).share == 4


def test_a_share_found_empty_ends_the_worker_or_says_nothing_is_readable():
    asked = []

    def others_readable(others):
        asked.append(others)
        return True

    empty = EmptyShards(["a", "b", "c", "d"], in_order=True, workers=2)
    assert not empty.shard_ended("a", 0, whole=True, any_readable=others_readable)
    assert not empty.shard_ended("c", 0, whole=False, any_readable=others_readable)  # resumed
    assert not empty.shard_ended("c", 3, whole=True, any_readable=others_readable)
    assert not asked  # a share with a readable shard never looks at the others
    assert empty.shard_ended("c", 0, whole=True, any_readable=others_readable)
    assert asked == [["b", "d"]]
    assert empty.shard_ended("a", 0, whole=True, any_readable=others_readable)  # checked once
    assert asked == [["b", "d"]]
    nothing = EmptyShards(["a", "b", "c", "d"], in_order=True, workers=2)
    nothing.shard_ended("b", 0, whole=True, any_readable=lambda others: False)
    said = r"the 4 TFRecord shard\(s\) this reader reads hold no readable record \(first a\)"
    with pytest.raises(DataError, match=said):
        nothing.shard_ended("d", 0, whole=True, any_readable=lambda others: False)


def test_a_cut_shard_that_ends_a_share_ends_once_however_often_grain_asks(four_shards, tmp_path):
    """Grain's interleave reads on past `ShareUnreadable`: asking again must end the shard, not
    read records framed from the bytes after the cut (a second skip logged at byte 12)."""
    copy = tmp_path / "cut"
    shutil.copytree(four_shards, copy)
    paths = [str(p) for p in load_dataset_info(copy).shard_paths("train")]
    Path(paths[0]).write_bytes(b"\xff" * 12 + Path(paths[0]).read_bytes()[12:])  # its length
    log = tmp_path / "skipped.jsonl"
    shard = TFRecordShard(
        paths[0],
        vocab_size=load_dataset_info(copy).vocab_size,
        skip_corrupt=True,
        skips=SkipLog(log),
        empty=EmptyShards(paths, in_order=True, workers=4),  # each worker reads one shard
    )
    it = iter(shard)
    assert isinstance(next(it), ShareUnreadable)
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    assert count_skipped(log) == 1


@pytest.mark.slow
def test_a_worker_whose_shards_are_all_unreadable_leaves_the_others_training(
    four_shards, tmp_path, repo_root
):
    """Before: exit 2 ('the 2 TFRecord shard(s) of the 4 of this split this reader reads hold no
    readable record') though data.workers=0 trains on shards 1 and 3."""
    data = garbled_copy(load_dataset_info(four_shards), tmp_path, [0, 2]).path
    code, err, rows = train(data, tmp_path / "workers2", 2, repo_root)
    assert code == 0, err
    assert "leaked shared_memory" not in err  # the run waited for Grain's unlinks
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["corrupt_records_skipped"] == 4
    # worker 1 reads shards 1, 3, 1, ...: the records one reader reads skipping shards 0 and 2
    alone = train_alone_in_this_process(data, tmp_path / "workers0", repo_root)
    assert [r["loss"] for r in rows] == [r["loss"] for r in alone]


@pytest.mark.slow
def test_no_readable_shard_with_workers_is_one_line(four_shards, tmp_path, repo_root):
    """Before: the line named worker 0's 2 shards and sent the user to data.shuffle=true, which
    reads the same unreadable split."""
    data = garbled_copy(load_dataset_info(four_shards), tmp_path, range(SHARDS)).path
    code, err, rows = train(data, tmp_path / "run", 2, repo_root)
    assert code == 2 and not rows
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "error: the 4 TFRecord shard(s) this reader reads hold no readable record (first "
    )
    assert last.endswith("re-run python -m input_pipeline.prepare --format tfrecord --overwrite")
