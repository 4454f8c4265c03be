"""`log.profile_steps: [start, end]`: a JAX profiler trace of steps start..end-1 (like `range`)
into `<workdir>/profile/`, for TensorBoard's profile plugin (`*.xplane.pb`) or Perfetto
(`*.trace.json.gz`). Profiling every step would slow the run and bury the steady state, hence
a window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from trainer.errors import TrainingError


class ProfileWindow:
    """Starts the trace before step `start` and stops it after step `end - 1`, blocking on the
    device at both ends so the trace holds exactly the window's device work."""

    def __init__(self, directory: str | Path, steps: tuple[int, int] | None):
        self.directory = Path(directory)
        self.steps = steps
        self.active = False

    def before_step(self, step: int, state: Any) -> None:
        if self.steps is None or self.active or step != self.steps[0]:
            return
        jax.block_until_ready(state)  # earlier steps' device work stays out of the trace
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        except RuntimeError as err:  # e.g. a trace the caller started is still running
            raise TrainingError(
                f"cannot start the profiler for log.profile_steps={list(self.steps)}: {err}; "
                "stop the other trace or unset log.profile_steps"
            ) from None
        self.active = True

    def after_step(self, step: int, outputs: Any) -> None:
        if self.active and step >= self.steps[1] - 1:
            self.stop(outputs)

    def stop(self, outputs: Any = None) -> None:
        """End the trace (also when the run ends inside the window)."""
        if not self.active:
            return
        if outputs is not None:
            jax.block_until_ready(outputs)  # the window's last step finishes inside the trace
        self.active = False
        jax.profiler.stop_trace()

    def __enter__(self) -> ProfileWindow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
