"""How one step spreads over many devices and processes: the device mesh and its sharding rules
(`sharding`), the sharded train state (`state`), the shardings and jitted steps for one mesh
(`program`), pipeline stages (`pipeline`), ZeRO-Offload to pinned host memory (`offload`), and
JAX's multi-process runtime (`distributed`). Import the modules themselves; this package
re-exports nothing."""
