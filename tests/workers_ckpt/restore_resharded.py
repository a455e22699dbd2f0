"""Restore a checkpoint in a process with another device count, in new layouts.

Usage: restore_resharded.py CKPT_DIR OUT.npz NUM_DEVICES

Restores the latest step onto a ("fsdp", NUM_DEVICES) mesh, each array
sharded on its first dimension that divides (else replicated), and writes the
values, plus each array's number of devices and shard shape, to OUT.npz; also
restores with no target (the saved mesh's devices do not all exist here, so
arrays come back replicated over all devices) and records "w" that way.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(sys.argv[3]))

import numpy as np  # noqa: E402

import dtensor  # noqa: E402


class FsdpLike:
    """Duck-typed strategy: a mesh and a variable_layout policy."""

    def __init__(self, mesh: dtensor.Mesh) -> None:
        self.mesh = mesh

    def variable_layout(self, path: str, leaf: object) -> dtensor.Layout:
        shape = np.shape(leaf)
        specs = [None] * len(shape)
        for dim, size in enumerate(shape):
            if size % self.mesh.size == 0:
                specs[dim] = "fsdp"
                break
        return dtensor.Layout(specs, self.mesh)


def main() -> None:
    ckpt_dir, out_path = sys.argv[1], sys.argv[2]
    mesh = dtensor.create_mesh([("fsdp", -1)])
    restored = dtensor.checkpoint.restore(ckpt_dir, FsdpLike(mesh))
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored):
        name = dtensor.core.tree.path_str(path)
        out[name] = np.asarray(leaf)
        out[name + ":devices"] = np.asarray(len(leaf.sharding.device_set))
        out[name + ":shard"] = np.asarray(leaf.addressable_shards[0].data.shape)
    plain = dtensor.checkpoint.restore(ckpt_dir)
    out["plain:w"] = np.asarray(plain["w"])
    out["plain:w:devices"] = np.asarray(len(plain["w"].sharding.device_set))
    out["plain:w:replicated"] = np.asarray(plain["w"].sharding.is_fully_replicated)
    np.savez(out_path, **out)
    print("DONE", jax.device_count(), flush=True)


if __name__ == "__main__":
    main()
