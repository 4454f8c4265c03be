"""Orbax checkpoints: train state, data positions and run metadata in one step folder per save.

Each is saved asynchronously, so the loop blocks only for the device-to-host copy. `checkpointer`
decides (which step restores, damaged ones set aside, saves checked and started); `reading` reads
one step's items; `items` says what a step folder holds; `failures` says what a failed read or
write shows; `manager` adapts Orbax's CheckpointManager."""

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.items import param_shapes

__all__ = ["Checkpointer", "param_shapes"]
