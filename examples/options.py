"""The demo's command-line options turned into a preset (``examples/train.py --strategy``).

Used by ``examples/train.py`` for training and for ``python -m dtensor.aot``.
"""

from __future__ import annotations

import argparse

SIZES = {
    #         dim, layers, heads, mlp, seq   (the character-level demo model)
    "demo": (64, 2, 4, 256, 64),
    "small": (128, 4, 4, 512, 128),
    "medium": (256, 6, 8, 1024, 256),
}
# The Gemma-style decoder of examples/decoder.py (its CONFIGS), for ahead-of-time compiles.
DECODER_SIZES = (
    "tiny",
    "tiny-gemma3",
    "tiny-llama",
    "2b",
    "7b",
    "gemma3-12b",
    "llama2-7b",
    "llama2-70b",
    "llama3.1-8b",
    "llama3.1-70b",
    "llama3.1-405b",
    "tiny-moe",
    "mixtral-8x7b",
)


def parse_args(argv: list[str] | None = None, *, description: str = "") -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=description.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--strategy", default="mirrored", help="a preset name (see --list-strategies)")
    p.add_argument("--list-strategies", action="store_true", help="list the presets and exit")
    p.add_argument("--steps", type=int, default=1000, help="total training steps (default 1000)")
    p.add_argument(
        "--model-size",
        choices=[*SIZES, *DECODER_SIZES],
        default="demo",
        help="demo/small/medium: the character-level model; tiny, 2b, 7b (Gemma), gemma3-12b, "
        "llama2-7b, llama2-70b, llama3.1-8b, llama3.1-70b, llama3.1-405b (and tiny-gemma3, tiny-llama): "
        "the decoder of examples/decoder.py, "
        "for python -m dtensor.aot (its aot_step; the large ones are only ever built abstractly)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
    p.add_argument(
        "--seq-len", type=int, default=None, help="sequence length (default: the size's)"
    )
    p.add_argument(
        "--mixed-precision",
        choices=["none", "bf16", "bf16-compute"],
        default="none",
        help="bf16: float32 variables, bfloat16 reads (strategies.MixedPrecision where the preset "
        "takes it, else the decoder casts its weight reads); bf16-compute: also bfloat16 "
        "arithmetic in modules whose dtype attribute says float32 (MixedPrecision(module_dtype=True))",
    )
    p.add_argument(
        "--remat",
        action="store_true",
        help="recompute each block in the backward pass (the preset's remat= where it takes it, "
        "else the decoder's own nnx.remat)",
    )
    p.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="FSDP: keep gathered weights for the backward pass",
    )
    p.add_argument(
        "--xla-plan", action="store_true", help="FSDP: gather_at_read=False (XLA's own plan)"
    )
    p.add_argument(
        "--gather-at-reads",
        action="store_true",
        help="FSDP: gather_at_read=True (the default on CPU only)",
    )
    p.add_argument(
        "--gather-layers",
        action="store_true",
        help="FSDP, XLA's plan, --remat --scan: gather each scanned layer inside the loop body",
    )
    p.add_argument(
        "--model-remat",
        action="store_true",
        help="with --remat: the decoder's own nnx.remat per block instead of the preset's remat=(Block,)",
    )
    p.add_argument(
        "--offload-optimizer", action="store_true", help="FSDP: optimizer state in host memory"
    )
    p.add_argument("--scan", action="store_true", help="decoder: run the layers with nnx.scan")
    p.add_argument(
        "--attention",
        choices=["auto", "xla", "splash", "cudnn"],
        default=None,
        help="decoder: the platform's best (auto, the default: splash on TPU, cudnn on NVIDIA "
        "GPUs in bf16, xla on CPU and for Gemma 3), attention as XLA einsums, the Pallas "
        "splash kernel (TPU; under --context in gather mode too) or cuDNN's fused attention",
    )
    p.add_argument(
        "--remat-policy",
        default=None,
        help="with --remat: what each block keeps on device, offloads to host or recomputes: "
        "MaxText's names (save_qkv_proj, qkv_proj_offloaded, minimal_offloaded, ...), "
        "per tensor ('decoder_layer_input=offload,query_proj=device'), or a "
        "jax.checkpoint_policies name (dots_saveable); default: keep only block inputs",
    )
    p.add_argument(
        "--data",
        type=int,
        default=None,
        help="hybrid: the data-parallel size (replicas, each fsdp over its share of the "
        "devices); default: one replica a slice",
    )
    p.add_argument(
        "--tensor",
        type=int,
        default=None,
        help="hybrid: the tensor-parallel size (the rest of the devices go to fsdp; the decoder's "
        "Megatron rules); default: the registry's data x fsdp x tensor",
    )
    p.add_argument(
        "--expert",
        type=int,
        default=None,
        help="hybrid: the expert-parallel size (stacked expert weights split over it, tokens "
        "dispatched by all-to-all; the rest of the devices go to fsdp); default 1",
    )
    p.add_argument(
        "--loss-chunks",
        type=int,
        default=None,
        help="decoder: the loss over the vocabulary in this many slices, one slice's float32 "
        "logits live at a time (MaxText's vocabulary tiling); default 1",
    )
    p.add_argument(
        "--loss-tiling",
        choices=("vocab", "tokens"),
        default=None,
        help="decoder, with --loss-chunks: slice the vocabulary (the logits recomputed in the "
        "backward pass; the default) or the tokens (each slice's gradients taken in the "
        "forward pass, nothing recomputed)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="hybrid: the context-parallel size (the sequence split over it; attention by "
        "dtensor.context_attention; the rest of the devices go to fsdp); default 1",
    )
    p.add_argument(
        "--context-mode",
        choices=["gather", "ring", "ulysses", "usp"],
        default=None,
        help="hybrid with --context: keys and values all-gathered (the default), passed "
        "round a ring, ulysses (all-to-alls to a head split around attention and back; "
        "the heads divide over --context, KV heads repeated where fewer), or usp (Ulysses "
        "within groups of gcd(--context, heads) devices, a ring across them)",
    )
    p.add_argument(
        "--stage",
        type=int,
        default=None,
        help="hybrid: the pipeline-parallel size (the decoder's blocks split over a stage axis, "
        "the batch through it in --microbatches; on several slices the stages span them); "
        "default 1",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="hybrid with --stage: microbatches per step; default: the stage count",
    )
    p.add_argument(
        "--schedule",
        choices=["gpipe", "circular", "1f1b", "interleaved-1f1b", "zero-bubble"],
        default=None,
        help="hybrid with --stage: GPipe (each stage its consecutive layers; the default), "
        "circular (each stage one layer per round, the ring gone round layers / stage times), "
        "or the schedules that interleave forward and backward so a stage holds about "
        "2 x stage microbatches' activations, not all: 1f1b, interleaved-1f1b (1f1b over the "
        "circular layout, microbatches a multiple of --stage), zero-bubble (weight gradients "
        "deferred into the cool-down)",
    )
    p.add_argument(
        "--across-slices",
        choices=["data", "fsdp", "stage"],
        default=None,
        help="hybrid, on a multi-slice TPU topology: the axis that spans the slices over DCN "
        "(data: each slice one data-parallel replica, fsdp within it; fsdp: one fsdp group over "
        "every chip); default: data on several slices (the lower step-time floor measured)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--devices",
        type=int,
        default=8,
        help="simulated CPU devices when no accelerator is present, in all: under dtensor.launch "
        "without --devices-per-process each of its N processes simulates devices / N",
    )
    p.add_argument(
        "--out",
        default="runs",
        help="where checkpoints, the plot and results go: a directory or a gs:// URL",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=250,
        help="also checkpoint every N steps (0: only on preemption)",
    )
    p.add_argument(
        "--local-checkpoints",
        metavar="DIR",
        help="a local checkpoint tier on each host's fast storage (a RAM disk or local SSD): "
        "each process keeps its own shards and a peer's there, and a restart resumes from the "
        "newest step of either tier",
    )
    p.add_argument(
        "--local-every",
        type=int,
        default=None,
        metavar="N",
        help="save the local tier every N steps, whatever --save-every says (default: with the "
        "persistent saves only)",
    )
    p.add_argument(
        "--fresh", action="store_true", help="ignore (delete) earlier checkpoints of this run"
    )
    p.add_argument("--sample-chars", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quiet",
        action="store_true",
        help="print only the final summary line (no tables, no progress bar)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with the run's results on stdout, nothing else",
    )
    p.add_argument(
        "--init-from",
        metavar="PATH",
        help="fine-tune a pretrained Hugging Face checkpoint (a folder with config.json and "
        "safetensors files, local or gs://; Llama, Mistral, Gemma...) instead of the "
        "character-level model: examples/decoder.py built from its config, each process "
        "reading only its slices of the weights",
    )
    p.add_argument(
        "--export-hf",
        metavar="DIR",
        help="with --init-from: after training, write the fine-tuned model into DIR as a "
        "Hugging Face folder (config.json: --init-from's architecture, float32; safetensors "
        "files and their index), which transformers' from_pretrained reads; local or gs://, "
        "written beside an existing DIR and swapped in whole. The character-level demo model "
        "has no Hugging Face architecture, so without --init-from it is refused",
    )
    args = p.parse_args(argv)
    if args.local_every is not None and not args.local_checkpoints:
        p.error("--local-every N needs --local-checkpoints DIR (each host's fast local storage)")
    if args.local_every is not None and args.local_every < 1:
        p.error(f"--local-every {args.local_every} is not valid; use a positive number of steps")
    return args


def build_strategy(
    args: argparse.Namespace, devices, block_cls=None, rules=None, *, decoder: bool | None = None
):
    """The preset named by ``--strategy`` over ``devices``, with the options it takes
    (``block_cls``: the model's block, for ``remat=`` and ``pipeline=``; ``rules``: the
    model's tensor-parallel rules, for ``hybrid`` with ``--tensor`` > 1; ``decoder``:
    whether the model is examples/decoder.py's, which takes ``dtype``/``remat``/attention
    changes of its own; by default, whether a block class is given).

    Returns ``(strategy, model_changes, applied)``: options the preset does not take
    fall back to the decoder's own (``dtype``/``remat``) where it has them, else are
    "not available"; ``applied`` says which for each.
    """
    import jax.numpy as jnp

    import strategies
    from strategies.step.memory_advice import accepts

    strategy = strategies.from_name(args.strategy, devices=devices)
    cls = type(strategy)
    wanted: dict[str, object] = {}
    applied: dict[str, str] = {}
    model_changes: dict[str, object] = {}
    if decoder is None:
        decoder = block_cls is not None
    for option in ("attention", "loss_chunks", "loss_tiling"):
        if getattr(args, option, None):
            if decoder:
                model_changes[option] = getattr(args, option)
            else:
                applied[option] = "not available"
    if args.mixed_precision in ("bf16", "bf16-compute"):
        if accepts(cls, "mixed_precision") and hasattr(strategies, "MixedPrecision"):
            extra = {"module_dtype": True} if args.mixed_precision == "bf16-compute" else {}
            wanted["mixed_precision"] = strategies.MixedPrecision(
                param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32, **extra
            )
            applied["mixed_precision"] = "strategy"
        elif decoder:
            model_changes["dtype"] = jnp.bfloat16
            applied["mixed_precision"] = "model (bf16 weight reads; preset option not available)"
        else:
            applied["mixed_precision"] = "not available"
    if args.remat:
        # The preset's remat=(Block,) and the decoder's own nnx.remat compile to the same
        # program (same peak on v5e:2x2); --model-remat asks for the decoder's.
        if accepts(cls, "remat") and block_cls is not None and not args.model_remat:
            wanted["remat"] = (block_cls,)
            applied["remat"] = "strategy"
        elif decoder:
            model_changes["remat"] = True
            applied["remat"] = "model (nnx.remat per block)"
        else:
            applied["remat"] = "not available"
    for flag, option, value in (
        ("no_reshard_after_forward", "reshard_after_forward", False),
        ("xla_plan", "gather_at_read", False),
        ("gather_at_reads", "gather_at_read", True),
        ("offload_optimizer", "offload_optimizer", True),
        ("gather_layers", "gather_layers", True),
    ):
        if getattr(args, flag):
            ok = accepts(cls, option)
            applied[option] = "strategy" if ok else "not available"
            if ok:
                wanted[option] = value
    if args.remat and args.remat_policy:
        ok = "remat" in wanted
        applied["remat_policy"] = "strategy" if ok else "not available"
        if ok:
            wanted["remat_policy"] = args.remat_policy
    hybrid = cls.__name__ == "HybridStrategy"
    across = getattr(args, "across_slices", None)
    if across is not None and not hybrid:
        applied["across_slices"] = "not available"
    expert = getattr(args, "expert", None) or 1
    if expert > 1 and not hybrid:
        applied["expert"] = "not available"
    context = getattr(args, "context", None) or 1
    if context > 1 and not hybrid:
        applied["context"] = "not available"
    stage = getattr(args, "stage", None) or 1
    if stage > 1 and not hybrid:
        applied["stage"] = "not available"
    expert *= context  # fsdp gets what tensor, expert and context leave
    data = getattr(args, "data", None)
    if data and not hybrid:
        applied["data"] = "not available"
    if hybrid and (args.tensor or decoder or across or expert > 1 or stage > 1 or data or wanted):
        from strategies.placement.slices import slice_count

        tensor = args.tensor or 1
        if len(devices) % tensor:
            raise ValueError(
                f"--tensor {tensor} does not divide the {len(devices)} devices; pass a divisor of it."
            )
        # fsdp over each slice's chips, one data-parallel replica per slice (--across-slices
        # data, and the default on several slices: llama2-70b on 2 x v5p:4x4x2, floor 1.17 s
        # against 1.74 s with fsdp over both), or over every chip (--across-slices fsdp).
        slices = slice_count(devices) if across != "fsdp" else 1
        if stage > 1 and across is None and slices > 1 and stage % slices == 0:
            across = "stage"  # the stages span the slices: only activations cross DCN
        if stage > 1 and across == "stage":
            slices = 1  # no data-parallel replicas: the slices are stages
        if len(devices) % stage or (len(devices) // stage) % tensor:
            raise ValueError(
                f"--stage {stage} x --tensor {tensor} does not divide the {len(devices)} "
                "devices; pass divisors of it."
            )
        if (len(devices) // slices) % tensor:
            if across == "data":
                raise ValueError(
                    f"--tensor {tensor} does not divide the {len(devices) // slices} devices of "
                    "a slice (--across-slices data); pass a divisor of it."
                )
            slices = 1
        if (len(devices) // slices // stage // tensor) % expert:
            raise ValueError(
                f"--expert x --context {expert} does not divide the "
                f"{len(devices) // slices // stage // tensor} devices left for fsdp x expert x context (of "
                f"{len(devices)}, {slices} slice(s), --tensor {tensor}); pass a divisor of it."
            )
        if data:  # --data D: D replicas, fsdp over what the other axes leave of each
            if len(devices) % (data * stage * tensor * expert):
                raise ValueError(
                    f"--data {data} x --stage {stage} x --tensor {tensor} x --expert x --context "
                    f"{expert} does not divide the {len(devices)} devices; pass divisors of it."
                )
            slices = data
        extra: dict[str, object] = {"rules": rules} if rules is not None and tensor > 1 else {}
        if expert // context > 1:
            extra["expert"] = expert // context
            applied["expert"] = "strategy"
        if context > 1:
            extra["context"] = context
            extra["context_mode"] = getattr(args, "context_mode", None) or "gather"
            applied["context"] = "strategy"
        if stage > 1:
            extra["stage"] = stage
            extra["pipeline"] = (block_cls,)
            extra["microbatches"] = getattr(args, "microbatches", None) or stage
            extra["schedule"] = getattr(args, "schedule", None) or "gpipe"
            applied["stage"] = "strategy"
        if across is not None:
            extra["across_slices"] = across
            applied["across_slices"] = "strategy"
        if "offload_optimizer" in wanted:
            applied["offload_optimizer"] = "not available"
            wanted.pop("offload_optimizer")
        if getattr(args, "gather_layers", False):  # HybridStrategy does it with remat=
            applied["gather_layers"] = "strategy (HybridStrategy's plan with remat=)"
        strategy = cls(
            slices,
            len(devices) // slices // stage // tensor // expert,
            tensor,
            devices=list(devices),
            min_shard_bytes=0,
            **extra,
            **wanted,
        )
    elif wanted:
        if cls.__name__ != "FullyShardedStrategy":
            applied.update({k: "not available" for k in wanted})
        else:
            strategy = cls(list(devices), min_shard_bytes=0, **wanted)
    return strategy, model_changes, applied
