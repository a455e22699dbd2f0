"""Worker: two processes load one Hugging Face checkpoint under FSDP, then save it back.

Usage: safetensors_two.py HF_DIR OUT_DIR

Each process reads only the slices its 4 devices hold (its reader's byte count goes in
the RESULT line), runs the tiny Llama on the stored tokens, and both write the checkpoint
again with save_safetensors (files dealt round the processes). Then two more saves over it:
one in which process 1's disk is full (both must raise, and the first save's files stay as
they were: their digests before and after go in the RESULT line), and one that succeeds
with a single file (none of the first save's shards may be left).
"""

from __future__ import annotations

import json
import sys


def _digests(folder: str) -> dict[str, str]:
    """Every file of ``folder`` (and any sibling the save left) -> its SHA-256."""
    import hashlib
    import os

    parent = os.path.dirname(os.path.abspath(folder))
    out = {}
    for root, _, files in os.walk(parent):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, parent)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def main() -> None:
    import dtensor

    dtensor.initialize(timeout_s=60)

    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    import strategies
    from dtensor.checkpoint import (
        CheckpointError,
        load_safetensors,
        safetensors_save,
        save_safetensors,
    )
    from examples.decoder import Decoder, from_hf_config, hf_mapping

    hf_dir, out_dir = sys.argv[1], sys.argv[2]
    cfg = from_hf_config(hf_dir, attention="xla")
    strategy = strategies.FullyShardedStrategy(min_shard_bytes=0)
    model = strategy.create(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    stats: dict = {}
    load_safetensors(hf_dir, model, mapping=hf_mapping(cfg), stats=stats)
    stored = np.load(f"{hf_dir}/logits.npz")
    tokens = np.tile(stored["tokens"], (4, 1))
    logits = strategy.run(lambda m, t: m(t), args=(model, tokens))
    logits = np.asarray(multihost_utils.process_allgather(logits, tiled=True))[:2]
    save_safetensors(out_dir, model, mapping=hf_mapping(cfg), max_shard_size="100KB")
    dtensor.barrier("saved")
    first = _digests(out_dir)
    real = safetensors_save._Writer.write

    def disk_full(self, array):
        if jax.process_index() == 1:
            raise OSError(28, "No space left on device")
        real(self, array)

    safetensors_save._Writer.write = disk_full  # this process only, for this one save
    try:
        save_safetensors(out_dir, model, mapping=hf_mapping(cfg), max_shard_size="100KB")
        failed = "no error"
    except CheckpointError as e:
        failed = str(e)
    finally:
        safetensors_save._Writer.write = real
    dtensor.barrier("failed")
    after_failure = _digests(out_dir)
    dtensor.barrier("checked")
    save_safetensors(out_dir, model, mapping=hf_mapping(cfg), max_shard_size="10MB")
    out = {
        "rank": jax.process_index(),
        "bytes_read": stats["bytes_read"],
        "max_diff": float(np.abs(logits - stored["logits"]).max()),
        "first": first,
        "after_failure": after_failure,
        "failed": failed,
    }
    dtensor.barrier("done")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
