"""Worker: two processes load one Hugging Face checkpoint under FSDP, then save it back.

Usage: safetensors_two.py HF_DIR OUT_DIR

Each process reads only the slices its 4 devices hold (its reader's byte count goes in
the RESULT line), runs the tiny Llama on the stored tokens, and both write the checkpoint
again with save_safetensors (files dealt round the processes).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import dtensor

    dtensor.initialize(timeout_s=60)

    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    import strategies
    from dtensor.checkpoint import load_safetensors, save_safetensors
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
    out = {
        "rank": jax.process_index(),
        "bytes_read": stats["bytes_read"],
        "max_diff": float(np.abs(logits - stored["logits"]).max()),
    }
    dtensor.barrier("done")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
