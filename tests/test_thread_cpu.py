"""The checkpoint benchmark's per-thread CPU accounting (benchmarks/_thread_cpu.py): the busy
steps' explanation in BENCHMARKS.md rests on it."""

import sys
import threading
import time

import pytest

from benchmarks import _thread_cpu as thread_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_thread_is_charged_its_cpu_time():
    before = thread_cpu.snapshot()
    burn(0.3)
    used = thread_cpu.spent(before, thread_cpu.snapshot())
    assert sum(user + system for user, system in used.values()) >= 0.25


def test_a_thread_that_ends_between_snapshots_takes_nothing_away():
    # Threads of one name (all Python threads share the interpreter's) were once summed by
    # name, so one that used CPU and then ended made that name's total go negative.
    stop = threading.Event()
    worker = threading.Thread(target=lambda: (burn(0.2), stop.wait()))
    worker.start()
    time.sleep(0.5)  # the worker has burned its CPU time by now
    before = thread_cpu.snapshot()
    stop.set()
    worker.join()
    used = thread_cpu.spent(before, thread_cpu.snapshot())
    assert all(user >= 0 and system >= 0 for user, system in used.values()), used
