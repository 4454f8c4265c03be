"""prepare at scale: parts prepared by separate processes and merged, and a prepare killed with
SIGKILL and re-run, give the same records and the same train/eval split as one uninterrupted
single-host prepare; the held-out fallback of a tiny corpus survives the streaming rewrite; a
process writing group after group stays at one group's memory."""

import ctypes
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader
from conftest import documents

from input_pipeline.prepare import main as prepare_main
from input_pipeline.prepare import prepare_dataset


def write_corpus(folder, files=6, per_file=20):
    """jsonl files (cut into byte ranges by a small --group-mb) and a few .txt documents."""
    folder.mkdir()
    docs = documents(files * per_file + 4, seed=3)
    for f in range(files):
        with open(folder / f"part-{f:02d}.jsonl", "w") as out:
            for text in docs[f * per_file : (f + 1) * per_file]:
                out.write(json.dumps({"text": text}) + "\n")
    for i, text in enumerate(docs[files * per_file :]):
        (folder / f"single-{i}.txt").write_text(text)
    return docs


def records_of(folder):
    """Each split's document count and records (sorted: the shard layout may differ)."""
    info = json.loads((folder / "dataset.json").read_text())
    out = {}
    for name, split in info["splits"].items():
        records = []
        for shard in split["shards"]:
            reader = ArrayRecordReader(str(folder / shard["file"]))
            records += reader.read_all()
            reader.close()
        assert len(records) == split["records"]
        out[name] = (split["documents"], split["tokens"], sorted(records))
    return out


def cli(corpus, output, *extra):
    return [
        sys.executable,
        "-m",
        "input_pipeline.prepare",
        "--input",
        str(corpus / "*"),
        "--output",
        str(output),
        "--eval-fraction",
        "0.1",
        "--group-mb",
        "0.004",
        "--no-progress",
        *extra,
    ]


def test_two_parts_then_merge_equal_one_single_host_prepare(tmp_path, repo_root):
    docs = write_corpus(tmp_path / "corpus")
    single = tmp_path / "single"
    assert prepare_main(cli(tmp_path / "corpus", single, "--workers", "2")[3:]) == 0
    expected = records_of(single)
    assert sum(d for d, _, _ in expected.values()) == len(docs)
    assert expected["eval"][0] >= 1

    parted = tmp_path / "parted"
    one_worker = ["--workers", "1"]  # two parts on two cores
    procs = [
        subprocess.Popen(
            cli(tmp_path / "corpus", parted, "--num-parts", "2", "--part", str(i), *one_worker),
            cwd=repo_root,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    merge = subprocess.run(
        cli(tmp_path / "corpus", parted, "--num-parts", "2", "--merge"),
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert merge.returncode == 0, merge.stderr[-2000:]
    assert records_of(parted) == expected
    assert not (tmp_path / ".parted.partial").exists()


def test_sigkilled_prepare_resumes_to_the_same_dataset(tmp_path, repo_root):
    # Many tiny records (--max-record-tokens 4) make each group slow enough to be killed mid-way.
    write_corpus(tmp_path / "corpus", files=8, per_file=40)
    args = ["--max-record-tokens", "4", "--workers", "1"]
    reference = tmp_path / "reference"
    assert prepare_main(cli(tmp_path / "corpus", reference, *args)[3:]) == 0

    output = tmp_path / "killed"
    staging = tmp_path / ".killed.partial"
    proc = subprocess.Popen(cli(tmp_path / "corpus", output, *args), cwd=repo_root)
    deadline = time.time() + 60
    while time.time() < deadline and len(list(staging.glob("group-*/done.json"))) < 2:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(staging.glob("group-*/done.json")))
    groups = len(json.loads((staging / "plan.json").read_text())["groups"])
    assert 2 <= done < groups, "the kill must land mid-way"
    assert not output.exists()  # nothing that looks complete

    rerun = subprocess.run(
        cli(tmp_path / "corpus", output, *args), cwd=repo_root, capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{done} of {groups} groups already done" in rerun.stderr
    assert records_of(output) == records_of(reference)


def test_a_corpus_without_held_out_documents_still_gets_one(tmp_path):
    docs = [f"document {i}" for i in range(5)]
    out = prepare_dataset(docs, tmp_path / "out", eval_fraction=1e-9, progress=False)
    eval_documents, _, eval_records = records_of(out)["eval"]
    assert eval_documents == 1  # the last training document moved, as before streaming
    assert np.frombuffer(eval_records[0], np.uint8).tobytes().decode() == docs[-1]
    assert records_of(out)["train"][0] == 4


def test_the_fallback_eval_document_is_one_with_a_next_token_pair(tmp_path):
    """Before: a small corpus whose last file was empty (or one character) held that one out as
    its eval split, and prepare refused it: 'the 1 held-out documents hold no next-token pair'."""
    docs = [f"document {i}" for i in range(5)]
    out = prepare_dataset([*docs, "", "x"], tmp_path / "out", eval_fraction=1e-9, progress=False)
    eval_documents, _, eval_records = records_of(out)["eval"]
    assert eval_documents == 1
    assert np.frombuffer(eval_records[0], np.uint8).tobytes().decode() == docs[-1]
    assert records_of(out)["train"][0] == 6  # the empty and one-token documents stay counted


def test_parts_share_one_trained_sentencepiece_model(tmp_path):
    write_corpus(tmp_path / "corpus", files=3)
    out = tmp_path / "sp"
    args = cli(tmp_path / "corpus", out, "--tokenizer", "sentencepiece", "--vocab-size", "300")
    args += ["--tokenizer-sample-sentences", "200", "--num-parts", "2", "--workers", "1"]
    assert prepare_main([*args[3:], "--part", "0"]) == 0
    assert not out.exists()  # part 1 has not run: nothing looks complete
    assert prepare_main([*args[3:], "--part", "1"]) == 0  # the last part to finish merges
    info = json.loads((out / "dataset.json").read_text())
    model = (out / "tokenizer.model").read_bytes()
    assert info["tokenizer"]["sha256"] == hashlib.sha256(model).hexdigest()
    assert info["vocab_size"] == 300 and info["splits"]["eval"]["documents"] >= 1
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(("train", "eval"))) == [
        "dataset.json",
        "prepared-shards.json",
        "tokenizer.model",
    ]


# A pool worker's life: group after group of one corpus, its RSS read after each one.
GROUPS_RSS = """
import json, sys
from dataclasses import asdict
from input_pipeline.shard_groups import Recipe, prepare_file_group
corpus, staging, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
recipe = asdict(Recipe("arrayrecord", 0.01, False, 4, 16384, "|u1"))
step, rss = 2 << 20, []
for i in range(count):
    piece = dict(file=corpus, start=i * step, end=(i + 1) * step, eval=False)
    prepare_file_group(staging, i, [piece], recipe, False, 1)
    rss.append(int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024)
print(json.dumps(rss))
"""


def glibc_malloc() -> bool:
    try:
        return callable(ctypes.CDLL(None).malloc_trim)
    except (AttributeError, OSError, TypeError):
        return False


@pytest.mark.skipif(not glibc_malloc(), reason="the growth was glibc's heap")
def test_memory_stays_flat_however_many_groups_a_process_writes(tmp_path, repo_root):
    """Issue 29: glibc kept in its heap the pages of the ArrayRecord buffers each finished group
    freed, so a prepare grew with every group (here +9 MB from groups 5-9 to groups 16-20)."""
    rng = np.random.default_rng(0)
    words = ["the", "model", "never", "waits", "for", "data", "déjà", "vu", "42", "shard"]
    pool = " ".join(rng.choice(words, size=2_000_000))
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        while f.tell() < 40 << 20:
            start, length = rng.integers(0, len(pool) - 20_000), rng.integers(100, 20_000)
            f.write(json.dumps({"text": pool[start : start + length]}) + "\n")
    done = subprocess.run(
        [sys.executable, "-c", GROUPS_RSS, str(corpus), str(tmp_path / "staging"), "20"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout)
    settled, last = np.mean(rss[4:9]), np.mean(rss[-5:])  # the first groups warm caches up
    assert last - settled <= 3, f"RSS after each group (MB): {rss}"


def add_null_lines(folder):
    """A `{"text": null}` line inside and at the end of each JSONL file; returns how many."""
    files = sorted(folder.glob("*.jsonl"))
    for i, path in enumerate(files):
        lines = path.read_text().splitlines(keepends=True)
        lines.insert(i % len(lines), '{"text": null}\n')
        path.write_text("".join(lines) + '{"text": null}\n')
    return 2 * len(files)


def test_null_texts_are_counted_across_workers_groups_and_parts(tmp_path, capsys):
    """Before: a JSONL null refused the corpus (and parquet nulls vanished unsaid). Each group
    counts its own null texts in its done.json and the merge adds them up: the same count with
    one process, two worker processes, or two parts merged by the last to finish."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    clean, corpus = tmp_path / "clean", tmp_path / "corpus"
    write_corpus(clean)
    shutil.copytree(clean, corpus)
    texts = documents(6, seed=5)
    pq.write_table(pa.table({"text": texts}), clean / "rows.parquet")
    pq.write_table(
        pa.table({"text": [None, *texts[:3], None, *texts[3:]]}), corpus / "rows.parquet"
    )
    nulls = 2 + add_null_lines(corpus)
    assert prepare_main(cli(clean, tmp_path / "reference")[3:]) == 0
    expected = records_of(tmp_path / "reference")
    for name, runs in {
        "one": [["--workers", "1"]],
        "two": [["--workers", "2"]],
        "parts": [["--num-parts", "2", "--part", str(i), "--workers", "1"] for i in range(2)],
    }.items():
        for args in runs:
            assert prepare_main(cli(corpus, tmp_path / name, *args)[3:]) == 0
        said = capsys.readouterr().err.splitlines()
        assert said[-1] == f"skipped {nulls} documents whose 'text' is null", name
        info = json.loads((tmp_path / name / "dataset.json").read_text())
        assert info["null_texts_skipped"] == nulls
        assert records_of(tmp_path / name) == expected  # nothing else changed


def test_the_merge_records_the_final_stamp_of_each_shard_unchanged_since_its_hash(tmp_path):
    """The trainer's first start skips the shards whose stamp is still the one prepare recorded
    (`PreparedShards`); the merge records it after each shard's last rename, and only for a
    shard whose inode, size and modification time are those it had when its group hashed it:
    not one written since in the staging folder, nor one of a group finished by a version that
    did not note them."""
    from input_pipeline.dataset_info import load_dataset_info
    from input_pipeline.shard_groups import WRITTEN
    from input_pipeline.verified import PREPARED_FILE, shared_stamp

    write_corpus(tmp_path / "corpus")
    output = tmp_path / "out"
    assert (
        prepare_main(cli(tmp_path / "corpus", output, "--num-parts", "2", "--part", "0")[3:]) == 0
    )
    staging = tmp_path / ".out.partial"
    groups = sorted(staging.glob("group-*/done.json"))
    assert len(groups) >= 2
    manifests = [json.loads(done.read_text()) for done in groups[:2]]
    touched, old = (
        [s for split in m["splits"].values() for s in split["shards"]] for m in manifests
    )
    first = groups[0].parent / touched[0]["file"]
    os.utime(first, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))
    for split in manifests[1]["splits"].values():
        for shard in split["shards"]:
            del shard[WRITTEN]
    groups[1].write_text(json.dumps(manifests[1]))

    assert (
        prepare_main(cli(tmp_path / "corpus", output, "--num-parts", "2", "--part", "1")[3:]) == 0
    )
    record = json.loads((output / PREPARED_FILE).read_text())
    checksums = load_dataset_info(output).checksums()
    unrecorded = {shard["sha256"] for shard in [touched[0], *old]}
    assert record == {
        path.name: [":".join(map(str, shared_stamp(path))), sha]
        for path, sha in checksums
        if sha not in unrecorded
    }
    assert len(record) == len(checksums) - 1 - len(old) > 0


def test_a_shard_written_after_its_stamp_is_hashed_at_the_first_start(tmp_path, monkeypatch):
    """prepare noted a shard's stamp after it read the shard for its sha256: bytes written in
    between (here, just after the read) were in a shard whose stamp prepare vouched for, so the
    first start trusted them unread. The stamp now comes before the read: the first start
    hashes that shard and refuses it."""
    from test_verified_shards import prepare_small, start, touch

    import input_pipeline.records
    from input_pipeline.errors import DataError

    real, written = input_pipeline.records.sha256_of, []

    def written_after_its_read(path):
        sha = real(path)
        if not written:  # the first shard closed
            with open(path, "r+b") as f:
                f.seek(-100, os.SEEK_END)
                f.write(bytes(b ^ 0xFF for b in f.read(1)))
            touch(path)  # a write within the clock tick of the last one may keep the times
            written.append(path.name)
        return sha

    monkeypatch.setattr(input_pipeline.records, "sha256_of", written_after_its_read)
    dataset = prepare_small(tmp_path / "data")
    monkeypatch.undo()
    assert written
    with pytest.raises(DataError, match="does not match the checksum"):
        start(dataset, tmp_path / "cache")


def test_a_rerun_with_other_options_keeps_the_finished_groups(tmp_path, capsys):
    """Before: a re-run after a kill with one flag changed deleted every finished group (hours
    of a large corpus) and said only 'it was made with other inputs or options'. Now it is
    refused, naming the flag, and the groups stay; an added input file is named."""
    corpus, output = tmp_path / "corpus", tmp_path / "out"
    write_corpus(corpus, files=3)
    staging = tmp_path / ".out.partial"
    args = cli(corpus, output, "--workers", "1")[3:]
    assert prepare_main([*args, "--num-parts", "2", "--part", "0"]) == 0  # a prepare half done
    done = len(list(staging.glob("group-*/done.json")))
    groups = len(json.loads((staging / "plan.json").read_text())["groups"])
    assert 0 < done < groups
    capsys.readouterr()

    assert prepare_main([*args, "--num-shards", "2"]) == 2
    said = capsys.readouterr().err.splitlines()
    assert said == [
        f"error: {staging} holds a prepare made with --num-shards 4 ({done} of {groups} groups "
        "done); re-run with the arguments it was made with to resume it, or delete that folder "
        "to start over"
    ]
    assert len(list(staging.glob("group-*/done.json"))) == done

    (corpus / "added.txt").write_text("one more document, added after the kill")
    assert prepare_main(args) == 0
    said = capsys.readouterr().err.splitlines()
    assert said[0].startswith(
        f"{staging} was made with other input files ({corpus / 'added.txt'} is new): keeping the "
    )
    splits = json.loads((output / "dataset.json").read_text())["splits"].values()
    assert sum(split["documents"] for split in splits) == 3 * 20 + 4 + 1  # every document, once


def test_ctrl_c_stops_every_process_with_one_line_and_keeps_the_finished_groups(
    tmp_path, repo_root
):
    """Before: Ctrl-C (SIGINT to the terminal's process group) printed a KeyboardInterrupt
    traceback from the parent and from every worker process. Now the workers ignore it, and
    the parent says in one line what is kept and how to resume, exit 130."""
    write_corpus(tmp_path / "corpus", files=8, per_file=40)
    output, staging = tmp_path / "out", tmp_path / ".out.partial"
    args = cli(tmp_path / "corpus", output, "--max-record-tokens", "4", "--workers", "2")
    # a handled (not ignored) SIGINT here: the child starts with the default, as from a shell
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # its own process group, as a terminal's foreground job
        proc = subprocess.Popen(
            args, cwd=repo_root, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    finally:
        signal.signal(signal.SIGINT, handler)
    deadline = time.time() + 60
    while time.time() < deadline and not list(staging.glob("group-*/done.json")):
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert err.splitlines()[-1] == (
        f"interrupted: {output} was not written; the finished groups stay in {staging}: re-run "
        "the same command to resume"
    )
    assert list(staging.glob("group-*/done.json")) and not output.exists()


def record_written_groups(monkeypatch) -> list[int]:
    """The indices of the groups an in-process (--workers 1) prepare writes, in order."""
    import input_pipeline.staging

    written, write = [], input_pipeline.staging.prepare_file_group

    def recording(staging, index, *rest):
        written.append(index)
        return write(staging, index, *rest)

    monkeypatch.setattr(input_pipeline.staging, "prepare_file_group", recording)
    return written


def test_a_fixed_input_file_redoes_only_the_groups_it_changed(tmp_path, capsys, monkeypatch):
    """Before: a re-run after fixing one file (an error line named a bad line in it) deleted
    every finished group, hours of a large corpus. The groups whose pieces and files are
    unchanged are kept, only the others are written again, and the dataset is the one a fresh
    prepare of the fixed corpus gives."""
    corpus, output = tmp_path / "corpus", tmp_path / "out"
    write_corpus(corpus)
    staging = tmp_path / ".out.partial"
    args = cli(corpus, output, "--workers", "1")[3:]
    assert prepare_main([*args, "--num-parts", "2", "--part", "0"]) == 0  # the first half
    done = sorted(int(p.parent.name.split("-")[1]) for p in staging.glob("group-*/done.json"))
    groups = len(json.loads((staging / "plan.json").read_text())["groups"])
    (corpus / "single-3.txt").write_text("the last file, fixed after the kill: " * 20)
    capsys.readouterr()

    written = record_written_groups(monkeypatch)
    assert prepare_main(args) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"{staging} was made with other input files ({corpus / 'single-3.txt'} changed size): "
        f"keeping the {len(done)} of {len(done)} finished groups whose input files are "
        "unchanged, redoing the rest"
    )
    assert sorted(written) == [i for i in range(groups) if i not in done]
    monkeypatch.undo()
    assert prepare_main(cli(corpus, tmp_path / "fresh", "--workers", "1")[3:]) == 0
    assert records_of(output) == records_of(tmp_path / "fresh")


def test_the_old_last_group_is_written_again_when_a_file_is_added_after_it(
    tmp_path, capsys, monkeypatch
):
    """The last group keeps its last training document aside as the corpus's fallback eval
    document; kept as a middle group, the merge would drop that document. Unchanged but no
    longer last, it is written again."""
    corpus, output = tmp_path / "corpus", tmp_path / "out"
    write_corpus(corpus, files=2)
    (corpus / "single-3.txt").write_text("a last file larger than one group. " * 150)
    args = cli(corpus, output, "--workers", "1", "--eval-fraction", "0.001")[3:]
    assert prepare_main([*args, "--num-parts", "2", "--part", "1"]) == 0  # the half with the last
    staging = tmp_path / ".out.partial"
    last = len(json.loads((staging / "plan.json").read_text())["groups"]) - 1
    assert "fallback" in json.loads((staging / f"group-{last:05d}" / "done.json").read_text())
    (corpus / "single-4.txt").write_text("a file added after the last one")

    written = record_written_groups(monkeypatch)
    assert prepare_main(args) == 0
    assert last in written and "keeping the" in capsys.readouterr().err
    monkeypatch.undo()
    assert (
        prepare_main(
            cli(corpus, tmp_path / "fresh", "--workers", "1", "--eval-fraction", "0.001")[3:]
        )
        == 0
    )
    assert records_of(output) == records_of(tmp_path / "fresh")
