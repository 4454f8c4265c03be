"""The metrics' `corrupt_records_skipped`: `SkippedCount` reads only what was appended to the skip
log since its last call (it was re-read whole at every metrics line), and counts a line only
once its newline is written."""

import json

from conftest import take
from skiplog import count_skipped

from input_pipeline.records import SkippedCount, append_line
from input_pipeline.streams import close_readers


def entry(record: int) -> str:
    return json.dumps({"shard": "/data/train-00000-of-00002.arrayrecord", "record": record})


def test_the_count_follows_lines_appended_between_calls(tmp_path):
    log = tmp_path / "skipped_records.0.jsonl"
    count = SkippedCount(log)
    assert count() == 0  # no log yet: nothing skipped
    for record in (1, 2):
        append_line(str(log), entry(record))
    assert count() == 2
    append_line(str(log), entry(2))  # another worker lists the same record: still one
    append_line(str(log), entry(3))
    assert count() == 3 == count_skipped(log)
    assert count() == 3  # nothing new


def test_a_partly_written_last_line_counts_once_it_is_complete(tmp_path):
    log = tmp_path / "skipped.jsonl"
    count = SkippedCount(log)
    append_line(str(log), entry(1))
    line = entry(2)
    with log.open("a") as f:
        f.write(line[:20])  # a write caught halfway
    assert count() == 1
    with log.open("a") as f:
        f.write(line[20:])  # all of the JSON, not yet its newline
    assert count() == 1
    with log.open("a") as f:
        f.write("\n")
    assert count() == 2 == count_skipped(log)
    append_line(str(log), entry(2))
    assert count() == 2


def test_each_call_reads_only_what_was_appended(tmp_path):
    """Lines already counted are not read again: rewriting one in place (a copy of another, same
    length) changes nothing, where a full re-read would see one record fewer."""
    log = tmp_path / "skipped.jsonl"
    count = SkippedCount(log)
    for record in (1, 2, 3):
        append_line(str(log), entry(record))
    assert count() == 3
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[1], *lines[1:]]) + "\n")  # same size, record 1 gone
    append_line(str(log), entry(4))
    assert count() == 4
    assert count_skipped(log) == 3  # what reading it all again would say


def test_a_log_replaced_by_a_shorter_one_is_counted_afresh(tmp_path):
    log = tmp_path / "skipped.jsonl"
    count = SkippedCount(log)
    for record in (1, 2, 3):
        append_line(str(log), entry(record))
    assert count() == 3
    log.unlink()
    append_line(str(log), entry(7))
    assert count() == 1


def test_the_run_counts_the_skipped_records_of_its_data(damaged, tmp_path):
    """What `trainer.data` hands the metrics: the records its readers skipped, distinct."""
    from trainer.config import load_config
    from trainer.data import dataset_sources

    copy, _ = damaged
    overrides = [f"data.path={copy}", "data.skip_corrupt=true", "data.verify_checksums=false"]
    config = load_config(None, [*overrides, "data.seq_len=64", "data.global_batch_size=8"])
    log = tmp_path / "skipped_records.0.jsonl"
    sources = dataset_sources(config.data, seed=0, skip_log=log)
    seen = []
    for _ in range(4):
        take(sources.train, 5)
        seen.append(sources.skipped_records())
    close_readers(sources.train)
    # Grain's read threads run ahead of `take` and may still finish a read after `close`, so the
    # log can grow between any two looks at it: the count must hold it from both sides.
    before, logged, after = sources.skipped_records(), count_skipped(log), sources.skipped_records()
    assert seen[-1] <= before <= logged <= after and logged > 0
    assert seen == sorted(seen)
