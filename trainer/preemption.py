"""Clean stops: the first SIGTERM or SIGINT asks the loop to finish the current step, save, and
exit 0; a second SIGINT aborts at once (KeyboardInterrupt)."""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """A context manager that turns termination signals into a flag the loop polls each step."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, _frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt("second SIGINT: aborting without saving")
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals need the main thread
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
