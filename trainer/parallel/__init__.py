"""How one step spreads over many devices and processes: the device mesh and its sharding rules
(`sharding`), the sharded train state (`state`), pipeline stages (`pipeline`), ZeRO-Offload to
pinned host memory (`offload`), and JAX's multi-process runtime (`distributed`). The program
that compiles the step for a mesh sits above them (`trainer/program.py`). Import the modules
themselves; this package re-exports nothing."""
