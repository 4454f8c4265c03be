"""Every test sees 8 fake CPU devices, so each sharding layout runs on a laptop, and on a GPU or
TPU host as well: the suite pins the CPU platform, for its own processes and every process they
start (they inherit the environment), so none takes accelerator memory and every mesh finds its 8
devices. Only `python -m pytest -m gpu` (tests/test_attention_gpu.py) runs on the GPU."""

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402
import sysconfig  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()  # Grain worker processes read absl flags

REPO = Path(__file__).resolve().parents[1]
GPU_MARKER = "gpu"


def gpu_selected(markexpr: str) -> bool:
    """Whether `-m` asks for the GPU tests (`-m gpu`, `-m "gpu and not slow"`; not `-m "not
    gpu"`)."""
    return bool(re.search(rf"(?<!not )\b{GPU_MARKER}\b", markexpr))


def pytest_configure(config):
    """Before any test module imports jax (and in each xdist worker, which runs this too): the
    CPU platform, unless the GPU tests are asked for. Then the GPU is shared by the workers, so
    none preallocates 75% of it."""
    if gpu_selected(config.option.markexpr):
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # also for children that reset JAX_* variables


def pytest_collection_modifyitems(config, items):
    slow_first(items)
    if gpu_selected(config.option.markexpr):
        return
    skip = pytest.mark.skip(reason="GPU test: run it with `python -m pytest -m gpu` on a GPU host")
    for item in items:
        if GPU_MARKER in item.keywords:
            item.add_marker(skip)


def slow_first(items: list) -> None:
    """Two halves of about as many tests, each its modules with slow tests first, every module
    kept whole (its module fixtures set up once), in their usual order otherwise: xdist's
    `worksteal` (pyproject.toml) gives each worker one half and lets an idle one take the end of
    the other's, so both start on the long real-process tests and end on short ones, not one on a
    long test while the other waits."""

    def module(item) -> str:
        return item.nodeid.split("::")[0]

    sizes = Counter(module(item) for item in items)
    slow_modules = {module(item) for item in items if "slow" in item.keywords}
    in_order = sorted(sizes, key=lambda name: name not in slow_modules)  # stable: usual order
    halves: tuple[list[str], list[str]] = ([], [])
    counts = [0, 0]
    for name in in_order:
        half = 0 if counts[0] <= counts[1] else 1
        halves[half].append(name)
        counts[half] += sizes[name]
    rank = {name: i for i, name in enumerate(halves[0] + halves[1])}
    items.sort(key=lambda item: rank[module(item)])


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def compile_cache(tmp_path_factory) -> dict[str, str]:
    """The environment of JAX's persistent compilation cache in this run's folder, for every
    compile (the tiny programs compile in under 1 s, JAX's default threshold). JAX writes an
    entry unlocked: a process that reads one while another writes it warns and compiles the
    program itself, and that warning would be a stray line in a child's stderr, which tests
    compare."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(run_folder(tmp_path_factory) / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "PYTHONWARNINGS": "ignore:Error reading persistent compilation cache entry",
    }


def run_folder(tmp_path_factory) -> Path:
    """This run's temporary folder, which both xdist workers' folders are in: one compilation
    cache there serves them both. JAX's cache key holds the cache's own path (XLA's caches live
    in it), so a program compiled in one worker's folder was never found from the other's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(
    tmp_path_factory, name: str, make: Callable[[Path], object], timeout_s: float = 900
) -> Path:
    """The folder `name` in this run's folder, made by `make(folder)` once for the whole run: the
    xdist worker that asks first makes it, holding a lock, while the other waits for it and then
    reads it. A `make` that fails leaves the folder unfinished, and the next one to ask makes it
    again."""
    folder = run_folder(tmp_path_factory) / name
    finished = folder.with_name(f"{name}.done")
    with held(folder.with_name(f"{name}.lock"), timeout_s):
        if not finished.exists():
            shutil.rmtree(folder, ignore_errors=True)
            make(folder)
            finished.touch()
    return folder


@contextlib.contextmanager
def held(lock: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive `flock` on the file `lock` while the block runs. The kernel drops it when its
    holder's process ends, so a worker that died holding it blocks nobody; one still holding it
    after `timeout_s` (stuck) fails the waiting test, naming the lock, instead of hanging it."""
    with lock.open("a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{lock} is still held by another test process after {timeout_s} s")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session", autouse=True)
def shared_compile_cache(tmp_path_factory):
    """The training processes tests start, and the tests' own in-process runs, compile the same
    tiny programs again and again: JAX's persistent compilation cache lets only the first of them
    in the run compile (a tiny CLI run took 9.5 s cold and 3.1 s warm here; a 2-process run
    saved ~20 s). One folder for both workers' own JAX and their children, so a CLI run after the
    same run in-process (a resume test's reference) compiles nothing. A load from the cache still
    fires JAX's backend-compile event, so the tests that count compiles count the same; tests
    that build their own environment (`test_multihost.cpu_env`) add `compile_cache` to it."""
    settings = compile_cache(tmp_path_factory)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in settings.items():
            patch.setenv(name, value)
        _use_compile_cache(settings["JAX_COMPILATION_CACHE_DIR"])
        try:
            yield
        finally:
            _use_compile_cache(None)


def _use_compile_cache(directory: str | None) -> None:
    """Point this process's JAX at `directory` for every compile from now on (None: off)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()  # the cache reads its folder once; make it read it again


@pytest.fixture
def sigint_as_in_a_terminal() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) during the test, as a run in a terminal
    has it: pytest started in the background (`cmd &` in a script) inherits SIGINT ignored, Python
    keeps it ignored, and so, rightly, does the run under test, whose Ctrl-C handling the test
    is about."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def error_lines_of_a_user_error(done: subprocess.CompletedProcess) -> list[str]:
    """The `error:` lines of a CLI run that must have ended as a user error: exit 2, and no
    traceback anywhere in its stderr."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def preloadable_library(tmp_path_factory, name: str, source: str) -> Path:
    """`source` (C) built as a shared library for LD_PRELOAD, to make chosen system calls of a
    child process fail with a real errno; skips the test without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip(f"needs a C compiler to build {name}")
    folder = tmp_path_factory.mktemp(name)
    (folder / f"{name}.c").write_text(source)
    library = folder / f"{name}.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", library, folder / f"{name}.c", "-ldl"], check=True
    )
    return library


# A small but real model and run shape shared by the end-to-end tests.
TINY = [
    "model.num_layers=2",
    "model.d_model=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=64",
    "data.global_batch_size=16",
    "optim.lr=3e-3",
    "optim.warmup_steps=5",
    "log.every=1",
    "log.progress=false",
    "eval.steps=2",
]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~1 MB of the running Python's own stdlib source, prepared like any user corpus."""
    from input_pipeline.prepare import prepare_dataset

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:120]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    out = tmp_path_factory.mktemp("data") / "stdlib-small"
    prepare_dataset(texts, out, eval_fraction=0.05, progress=False)
    return out


@pytest.fixture
def damaged(corpus, tmp_path):
    """A copy of the shared corpus with bytes of one train shard flipped."""
    return flipped_copy(corpus, tmp_path / "damaged", "train-00000-*")


def flipped_copy(dataset: Path, copy: Path, pattern: str) -> tuple[Path, Path]:
    """A copy of `dataset` whose first shard matching `pattern` has the bytes of its first half
    (past its header) flipped; the copy and that shard."""
    import shutil

    shutil.copytree(dataset, copy)
    shard = sorted(copy.glob(pattern))[0]
    data = bytearray(shard.read_bytes())
    for i in range(200, len(data) // 2):
        data[i] ^= 0x5A
    shard.write_bytes(bytes(data))
    return copy, shard


def tiny_cli(args, workdir) -> list[str]:
    """The argv of `python -m trainer.main` on the tiny config with `args`, run in `workdir`."""
    return [
        sys.executable,
        "-m",
        "trainer.main",
        "--config",
        "configs/tiny.yaml",
        *args,
        f"run.workdir={workdir}",
    ]


def tiny_in_process(args, workdir):
    """What `tiny_cli(args, workdir)` runs, through the library in the test's own process (a run
    that fails raises): for a run whose process is not what a test is about (one that sets up a
    checkpoint for the CLI run under test), which a new process makes seconds longer."""
    from trainer.config import load_config
    from trainer.train import run

    return run(load_config(REPO / "configs/tiny.yaml", [*args, f"run.workdir={workdir}"]))


# One learning-rate schedule for runs whose checks do not depend on it, whatever their run.steps:
# the schedule's length is compiled into the train step, so the runs that set this one share a
# compiled step through the compilation cache (`shared_compile_cache`) instead of compiling one
# per run.steps (several seconds each).
SHARED_SCHEDULE = "optim.decay_steps=40"


def tiny_run(corpus, workdir, steps=4):
    """The TINY model trained on `corpus` in `workdir` for `steps`: a checkpoint every 2 steps,
    no eval before the last step, no TensorBoard, and the `SHARED_SCHEDULE`."""
    from trainer.config import load_config

    return load_config(
        None,
        [
            *TINY,
            f"data.path={corpus}",
            f"run.workdir={workdir}",
            f"run.steps={steps}",
            SHARED_SCHEDULE,
            "checkpoint.every=2",
            "eval.every=100",
            "log.tensorboard=false",
        ],
    )


def documents(n=60, seed=0):
    """Documents of very different lengths, each with a recognizable first line; the longer
    ones are cut into several records at max_record_tokens=512."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "import", "return", "self", "(", ")", ":"]
    return [
        f"doc {i}\n" + " ".join(rng.choice(words, size=int(rng.integers(3, 400)))) for i in range(n)
    ]


def records_in(batches) -> list[bytes]:
    """Every record of packed `batches`, rebuilt from its rows' segments (one record never spans
    rows), as bytes of its byte tokens."""
    seen = []
    for batch in batches:
        for row, segments in enumerate(batch["segment_ids"]):
            for s in range(1, segments.max() + 1):
                inside = segments == s
                tokens = [*batch["inputs"][row][inside], batch["targets"][row][inside][-1]]
                seen.append(bytes(np.asarray(tokens, np.uint8)))
    return seen


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def same(a, b):
    """Two batch dicts with equal arrays under every key."""
    return all(np.array_equal(a[k], b[k]) for k in a)


def garble_records(shard: Path) -> None:
    """Flip the bytes of an ArrayRecord `shard`'s records but keep its index readable: every
    record of it then fails to read while the shard still opens."""
    import grain

    data = shard.read_bytes()
    end = data.rstrip(b"\0").find(b"\0" * 64)  # the records and index; then block padding
    for stop in range(end, 64, -100):
        garbled = bytearray(data)
        garbled[64:stop] = bytes(b ^ 0x5A for b in garbled[64:stop])
        shard.write_bytes(bytes(garbled))
        try:
            grain.sources.ArrayRecordDataSource([str(shard)])
            return
        except RuntimeError:
            continue
    raise AssertionError(f"could not garble {shard} and keep its index readable")


FOUR_RECORD_TOKENS = 2**19


@pytest.fixture(scope="session")
def four_records(tmp_path_factory) -> Path:
    """4 train records of 2^19 byte tokens in 2 shards (records 0-1 and 2-3), no eval split."""
    from input_pipeline.prepare import prepare_dataset

    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghij klmnopqrst\nuvwxyz", np.uint8)
    text = rng.choice(letters, 4 * FOUR_RECORD_TOKENS).tobytes().decode()
    out = tmp_path_factory.mktemp("data") / "four-records"
    return prepare_dataset(
        [text],
        out,
        eval_fraction=0,
        num_shards=2,
        max_record_tokens=FOUR_RECORD_TOKENS,
        progress=False,
    )
