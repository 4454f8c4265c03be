"""User-facing data errors: one line naming the file or key and the fix; the CLI exits 2."""


class DataError(ValueError):
    """A problem with a dataset a user can fix (missing path, corrupt shard, bad setting)."""


def damaged_shard(path: str, reason: str, fix: str) -> str:
    """The line for a shard that cannot be read: which, why, and re-running prepare with `fix`
    (options, then what else helps: it depends on the format and reader)."""
    return (
        f"shard {path} is corrupt or truncated ({reason}); re-run python -m "
        f"input_pipeline.prepare {fix}"
    )
