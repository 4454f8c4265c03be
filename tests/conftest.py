"""Every test sees 8 fake CPU devices, so each sharding layout runs on a laptop."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sysconfig  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()  # Grain worker processes read absl flags

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


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


def documents(n=60, seed=0):
    """Documents of very different lengths, each with a recognizable first line; the longer
    ones are cut into several records at max_record_tokens=512."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "import", "return", "self", "(", ")", ":"]
    return [
        f"doc {i}\n" + " ".join(rng.choice(words, size=int(rng.integers(3, 400)))) for i in range(n)
    ]


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def same(a, b):
    """Two batch dicts with equal arrays under every key."""
    return all(np.array_equal(a[k], b[k]) for k in a)
