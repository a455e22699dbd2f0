"""Worker: two processes write one checkpoint of arrays sharded over both, then restore it.

Usage: ckpt_two_writers.py CKPT_DIR

Each process holds half of "w" (rows split over all 4 devices of 2 processes),
so each writes its own shards (orbax's state/ocdbt.process_<i>/). Restores the
step into the saved layout and into a replicated one, and prints one RESULT
line with whether the values came back bit for bit.
"""

from __future__ import annotations

import json
import logging
import sys


def main() -> None:
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    import dtensor

    dtensor.initialize(timeout_s=60)

    import jax
    import numpy as np

    from dtensor import checkpoint

    mesh = dtensor.create_mesh([("x", jax.device_count())])
    full = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)
    w = dtensor.copy_to_mesh(full, dtensor.Layout(["x", None], mesh))
    checkpoint.save(sys.argv[1], {"w": w, "n": np.int32(3)}, step=1)
    same = checkpoint.restore(sys.argv[1])
    rep = checkpoint.restore(
        sys.argv[1], {"w": dtensor.Layout.replicated(mesh, 2), "n": np.int32(0)}
    )
    local = [np.asarray(s.data) for s in same["w"].addressable_shards]
    want = [full[s.index] for s in w.addressable_shards]
    out = {
        "rank": jax.process_index(),
        "same_bits": all(a.tobytes() == b.tobytes() for a, b in zip(local, want, strict=True)),
        "replicated_bits": np.asarray(rep["w"].addressable_data(0)).tobytes() == full.tobytes(),
        "layout": dtensor.fetch_layout(same["w"]).to_string(),
    }
    dtensor.barrier("done")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
