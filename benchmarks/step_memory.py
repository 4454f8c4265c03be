"""Per-device memory of a config's compiled train step, from XLA's own buffer assignment:
compiled ahead of time for a mesh of N fake CPU devices, with no array allocated.

    python benchmarks/step_memory.py --config configs/1b_fp16_4x11gb.yaml --devices 4 [overrides]

Prints the train state each device holds (parameters, optimizer state, loss scale) and the
compiled step's argument, output, temporary and peak bytes. XLA:CPU lays buffers out as XLA:GPU
does in kind, not to the byte (fusion and kernels differ): a CPU figure is an estimate of a GPU's.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--devices", type=int, default=4, help="fake CPU devices in the mesh")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax
    import numpy as np

    from trainer import sharding
    from trainer.config import load_config
    from trainer.program import build_program
    from trainer.train import builder_for_vocab

    config = load_config(args.config, args.overrides)
    mesh = sharding.make_mesh(config.mesh)
    vocab = config.model.vocab_size or 256
    program = build_program(config, mesh, builder_for_vocab(config, vocab))
    state = program.abstract_state()
    B, L = config.data.global_batch_size, config.data.seq_len
    batch = {
        name: jax.ShapeDtypeStruct((B, L), dtype, sharding=program.batch_sharding)
        for name, dtype in [
            ("inputs", np.int32),
            ("targets", np.int32),
            ("segment_ids", np.int32),
            ("positions", np.int32),
            ("weights", np.float32),
        ]
    }

    def per_device(tree) -> float:
        return sum(
            int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
            for leaf in jax.tree.leaves(tree)
        )

    with jax.set_mesh(mesh):
        compiled = program.train_step.lower(state, batch).compile()
    memory = compiled.memory_analysis()
    gb = 1e9
    print(
        f"{args.config} on {args.devices} devices, mesh {dict(mesh.shape)}: "
        f"{program.num_params / 1e9:.3f}B parameters"
    )
    print(
        f"per device: parameters {per_device(state.params) / gb:.2f} GB, optimizer state "
        f"{per_device(state.opt_state) / gb:.2f} GB, whole train state "
        f"{per_device(state) / gb:.2f} GB"
    )
    arguments = memory.argument_size_in_bytes
    temporaries = memory.temp_size_in_bytes
    outputs = memory.output_size_in_bytes
    aliased = memory.alias_size_in_bytes
    peak = arguments + outputs - aliased + temporaries
    print(
        f"compiled step per device: arguments {arguments / gb:.2f} GB, outputs "
        f"{outputs / gb:.2f} GB (of which {aliased / gb:.2f} GB donated in place), temporaries "
        f"{temporaries / gb:.2f} GB; peak {peak / gb:.2f} GB"
    )


if __name__ == "__main__":
    main()
