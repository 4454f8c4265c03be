"""What a failed checkpoint read or write shows: damaged files, a storage error, a full disk."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re

from trainer.errors import first_line

# What Orbax 0.12 and TensorStore raise for a step's own files that are damaged: an item folder
# missing, a stored array of another shape than the listed one, and TensorStore's status codes for
# bytes that are short, missing or do not decode (an OS error is `UNKNOWN` with its code).
ORBAX_DAMAGE = ("was not found in the checkpoint", "is not compatible with the stored shape")
TENSORSTORE_DAMAGE = ("OUT_OF_RANGE:", "DATA_LOSS:", "FAILED_PRECONDITION:", "NOT_FOUND:")
TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")

DISK_FULL = ("No space left on device", "os_error_code='28'", "[Errno 28]")
NOT_WRITABLE = ("Permission denied", "Read-only file system", "[Errno 13]", "[Errno 30]")


class DamageError(Exception):
    """What a step's own metadata shows to be damaged (valid JSON, but not what a save writes)."""


# Errors that say a step's file is missing or does not parse.
DAMAGED_FILES = (DamageError, json.JSONDecodeError, UnicodeDecodeError, FileNotFoundError)


def storage_problem(err: BaseException) -> str | None:
    """What a full or unwritable folder did to `err`'s write ("is full ..."), or None."""
    code, text = getattr(err, "errno", None), str(err)
    if code == errno.ENOSPC or mentions(text, DISK_FULL):
        return "is full (no space left on device)"
    if code in (errno.EACCES, errno.EROFS) or mentions(text, NOT_WRITABLE):
        return "is not writable"
    return None


def mentions(text: str, phrases: tuple[str, ...]) -> bool:
    return any(phrase in text for phrase in phrases)


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and its causes, outermost first: Orbax wraps TensorStore's error (`OUT_OF_RANGE:
    Error reading ...`), or an interrupt that came during a read, in a generic one."""
    chain = [err]
    for _ in range(20):
        inner = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        if inner is None:
            break
        chain.append(inner)
        err = inner
    return chain


def chain_has(err: BaseException, kind: type[BaseException]) -> bool:
    return any(isinstance(e, kind) for e in _chain(err))


def interrupt_in(err: BaseException) -> BaseException | None:
    """A KeyboardInterrupt, a stop (`trainer.preemption.Stopped`) or a SystemExit that Orbax's
    read wrapped in an `Exception` ("Encountered error while reading ..."); a cancelled or closed
    task's error is not one (it shows no damage either: the restore stops,
    `Checkpointer._left_in_place`)."""
    no_interrupt = (Exception, asyncio.CancelledError, GeneratorExit)
    return next((e for e in _chain(err) if not isinstance(e, no_interrupt)), None)


def read_problem(err: BaseException) -> str | None:
    """The OS error, other than a missing file, that a read of the checkpoint met ("Stale file
    handle [ESTALE]"): Python's, or TensorStore's `[os_error_code='116']`; or None."""
    for e in _chain(err):
        code = e.errno if isinstance(e, OSError) else None
        if code is None and (found := TENSORSTORE_OS_ERROR.search(str(e))) is not None:
            code = int(found[1])
        if code is not None and code != errno.ENOENT:
            where = f" reading {e.filename}" if getattr(e, "filename", None) else ""
            return f"{os_error(code)}{where}"
    return None


def os_error(code: int) -> str:
    """An OS error in words, with its name to search for: "Stale file handle [ESTALE]"."""
    return f"{os.strerror(code)} [{errno.errorcode.get(code, str(code))}]"


def damage_in(err: BaseException) -> str | None:
    """Why `err`, a failed restore, shows the step's own files damaged (a file missing, short,
    not decoding or not parsing, an array of another shape than listed), or None: no evidence.
    A read error of the storage is none (`read_problem` is asked first)."""
    if read_problem(err) is not None:
        return None
    for e in _chain(err):
        text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if (
            isinstance(e, DAMAGED_FILES)
            or (isinstance(e, KeyError | ValueError) and mentions(text, ORBAX_DAMAGE))
            or (isinstance(e, ValueError) and text.startswith(TENSORSTORE_DAMAGE))
        ):
            return first_line(e, with_type=False)
    return None
