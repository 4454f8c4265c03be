"""User-facing data errors: one line naming the file or key and the fix; the CLI exits 2."""


class DataError(ValueError):
    """A problem with a dataset a user can fix (missing path, corrupt shard, bad setting)."""
