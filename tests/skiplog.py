"""Reading a skip log in the tests: how many distinct records it lists."""

from pathlib import Path

from input_pipeline.records import SkippedCount


def count_skipped(skip_log: str | Path) -> int:
    """Distinct records listed in `skip_log`, read once (as the metrics' `SkippedCount` reads
    them all at its first call)."""
    return SkippedCount(skip_log)()
