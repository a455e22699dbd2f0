"""Regenerate ``hf_llama.npz`` / ``hf_gemma.npz`` / ``hf_gemma3.npz``: Hugging Face
``transformers``' own logits for the tiny weights of ``hf_weights.py`` (run by hand; the
suite never needs torch).

    python3.11 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy   # CPU torch
    /tmp/hfvenv/bin/python tests/data/make_hf.py [--arch gemma3] [--save-pretrained DIR]
    /tmp/hfvenv/bin/python tests/data/make_hf.py --check DIR    # a checkpoint we wrote

(``hf_gemma3.npz`` was made with torch 2.14.1 and transformers 5.25.0.)

Writes ``hf_<arch>.json`` (the ``config.json`` transformers writes) and ``hf_<arch>.npz``
(``tokens``, ``logits`` in float32, ``checksum`` of the weights). ``--save-pretrained DIR``
also writes ``DIR/<arch>`` with ``save_pretrained(max_shard_size="100KB")`` (sharded files
and an index, as on the Hub) for checking ``dtensor.checkpoint.load_safetensors`` on files
transformers wrote. ``--check DIR`` loads ``DIR`` (a Llama checkpoint written by
``dtensor.checkpoint.save_safetensors``) with ``from_pretrained`` and prints the largest
difference of its logits from the stored ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_weights  # noqa: E402

SPECS = {"llama": hf_weights.LLAMA, "gemma": hf_weights.GEMMA, "gemma3": hf_weights.GEMMA3}


def build(arch: str):
    import torch
    import transformers

    config = dict(SPECS[arch])
    cls_name = config.pop("architectures")[0]
    config.pop("model_type")
    config.pop("torch_dtype")
    if arch == "gemma3":  # transformers 5 takes each attention kind's RoPE as rope_parameters
        config["rope_parameters"] = {
            "full_attention": {
                **config.pop("rope_scaling"),
                "rope_theta": config.pop("rope_theta"),
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": config.pop("rope_local_base_freq"),
            },
        }
    cfg_cls = {
        "llama": transformers.LlamaConfig,
        "gemma": transformers.GemmaConfig,
        "gemma3": transformers.Gemma3TextConfig,
    }[arch]
    cfg = cfg_cls(**config)
    cfg.architectures = [cls_name]
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).float().eval()
    tensors = hf_weights.weights(SPECS[arch])
    state = {k: torch.from_numpy(v) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight" or not cfg.tie_word_embeddings]
    assert not missing and not unexpected, (missing, unexpected)
    return model, tensors


def logits(model, arch: str) -> np.ndarray:
    import torch

    toks = torch.from_numpy(hf_weights.tokens(SPECS[arch]).astype(np.int64))
    with torch.no_grad():
        return model(toks).logits.float().numpy()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save-pretrained", type=Path)
    p.add_argument("--check", type=Path)
    p.add_argument("--arch", choices=list(SPECS), action="append", help="default: all")
    args = p.parse_args()
    if args.check:
        import transformers

        model = transformers.LlamaForCausalLM.from_pretrained(args.check).float().eval()
        got = logits(model, "llama")
        want = np.load(HERE / "hf_llama.npz")["logits"]
        print(f"max |logits - stored| = {np.abs(got - want).max():.3g}")
        return
    for arch in args.arch or list(SPECS):
        model, tensors = build(arch)
        spec = SPECS[arch]
        out = logits(model, arch)
        np.savez(
            HERE / f"hf_{arch}.npz",
            tokens=hf_weights.tokens(spec),
            logits=out.astype(np.float32),
            checksum=np.float64(hf_weights.checksum(tensors)),
        )
        (HERE / f"hf_{arch}.json").write_text(model.config.to_json_string())
        if args.save_pretrained:
            model.save_pretrained(args.save_pretrained / arch, max_shard_size="100KB")
        print(arch, out.shape, float(np.abs(out).max()))


if __name__ == "__main__":
    main()
