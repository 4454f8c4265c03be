"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import NoReturn

from input_pipeline.errors import DataError


class ConfigError(ValueError):
    """A config value a user can fix: the message names the key, the problem and the fix."""


class TrainingError(RuntimeError):
    """A run that cannot go on (a NaN loss, a checkpoint from another model): message says why."""


# What a command line ends in one line and exit 2, not a traceback: what its user can fix.
USER_ERRORS = (ConfigError, DataError, TrainingError)

LINE_LIMIT = 240  # characters of an error's message that a one-line report quotes


def first_line(err: BaseException, *, with_type: bool = True) -> str:
    """An error as one short line for a one-line report (XLA's and Orbax's run to many lines):
    its type's name (unless `with_type` is false), then the first line of its message, cut at
    LINE_LIMIT characters."""
    if isinstance(err, KeyError) and err.args:
        text = str(err.args[0])  # the key, not its repr
    elif isinstance(err, json.JSONDecodeError):
        text = f"invalid JSON: {err}"  # "Expecting value: line 1 ..." alone does not say what
    else:
        text = str(err)
    line = (text.strip().splitlines() or [""])[0].strip()
    if not line:
        line = type(err).__name__
    elif with_type:
        line = f"{type(err).__name__}: {line}"
    return line if len(line) <= LINE_LIMIT else line[: LINE_LIMIT - 3] + "..."


def say_now(line: str) -> None:
    """Write `line` to stderr from a signal handler, or just before `os._exit`: straight to the
    file descriptor, as the handler may run in the middle of a print (what was printed before
    is flushed first)."""
    _flush_prints()
    with contextlib.suppress(OSError):
        os.write(2, f"{line}\n".encode())  # stderr's descriptor


def exit_now(status: int, line: str | None = None) -> NoReturn:
    """End the process at once with `status`, after `line` (if any) and what was printed before:
    where Python's exit-time cleanup would wait, in JAX's shutdown of a runtime that is half made
    or shared with processes that will not come."""
    if line is None:
        _flush_prints()
    else:
        say_now(line)
    os._exit(status)


def _flush_prints() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a print that a signal handler interrupted
            stream.flush()
