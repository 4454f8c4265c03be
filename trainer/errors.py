"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""


class ConfigError(ValueError):
    """A config value a user can fix: the message names the key, the problem and the fix."""


class TrainingError(RuntimeError):
    """A run that cannot go on (a NaN loss, a checkpoint from another model): message says why."""
