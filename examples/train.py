"""Train a character-level Flax NNX transformer under any preset: the main demo.

    python examples/train.py                       # mirrored, 8 simulated CPU devices
    python examples/train.py --strategy fully_sharded
    python examples/train.py --list-strategies
    python -m dtensor.launch -n 2 -- python examples/train.py --strategy multi_worker_mirrored  # 2 x 4 devices
    python -m dtensor.aot --topology v5e:4x4 --strategy fully_sharded -- examples/train.py \
        --model-size 7b --batch-size 16 --seq-len 1024 --mixed-precision bf16 --remat

The corpus is built at run time from the Python standard library's own
docstrings and source (nothing is downloaded) and read through a Grain
pipeline, each process reading its share of every batch. The run shows the
mesh and every variable's layout, a progress bar, the compiled step's
communication and memory, checkpoints through the preemption handler (Ctrl-C
or SIGTERM saves model, optimizer and the pipeline's position, and exits;
running again resumes all three), a loss curve and a generated sample.

``--init-from PATH`` fine-tunes a pretrained Hugging Face checkpoint (``config.json`` and
``*.safetensors``, a local folder or ``gs://``) instead: ``examples/decoder.py`` built from
its config in the preset's layouts, each process reading only its slices of the weights
(its vocabulary must cover the corpus's 128 ASCII codes). ``--export-hf DIR`` then writes
the fine-tuned model back as a Hugging Face folder (``config.json`` of PATH's architecture,
float32 safetensors files and their index) that ``transformers``' ``from_pretrained`` reads;
every process takes part (on several hosts, DIR is a bucket or a shared file system):

    python -m dtensor.launch -n 2 -- python examples/train.py --strategy fully_sharded \
        --init-from PATH --export-hf DIR

The character-level model (without ``--init-from``) has no Hugging Face architecture:
``--export-hf`` without ``--init-from`` is refused before anything runs (its weights are in
the run's checkpoints, ``--out``).

``--out`` takes a directory or a bucket URL: with ``--out gs://BUCKET/run``
the checkpoints, the loss curve and ``results.json`` live in the bucket (try it
without a cloud account against ``gcp-storage-emulator``; see the README).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path


def sibling(name: str):
    """``examples/<name>.py``, imported once (this script may itself be loaded from a path)."""
    import importlib.util

    key = f"_dtensor_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            key, Path(__file__).resolve().parent / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


_options = sibling("options")
SIZES = _options.SIZES  # the character-level demo model's sizes
VOCAB = sibling("corpus").VOCAB  # ASCII; anything else becomes '?'
DECODER_SIZES = _options.DECODER_SIZES  # examples/decoder.py's, for ahead-of-time compiles
#: How the last aot_step applied --mixed-precision / --remat / ... (read by benchmarks).
LAST_OPTIONS: dict[str, str] = {}


# ---------------------------------------------------------------------- model
@functools.cache
def make_model_cls():
    """The character-level model's class (one class a process: ``CharLM.Block`` is what
    ``remat=`` and ``pipeline=`` name, so a second build must not make another)."""
    import jax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, dim: int, heads: int, mlp: int, rngs: nnx.Rngs):
            self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=heads,
                in_features=dim,
                qkv_features=dim,
                decode=False,
                use_bias=False,
                rngs=rngs,
            )
            self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
            self.up = nnx.Linear(dim, mlp, rngs=rngs)
            self.down = nnx.Linear(mlp, dim, rngs=rngs)

        def __call__(self, h, mask):
            h = h + self.attn(self.ln1(h), mask=mask)
            return h + self.down(jax.nn.gelu(self.up(self.ln2(h))))

    class CharLM(nnx.Module):
        def __init__(self, dim: int, layers: int, heads: int, mlp: int, seq: int, rngs: nnx.Rngs):
            self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
            self.pos = nnx.Embed(seq, dim, rngs=rngs)
            self.blocks = nnx.List([Block(dim, heads, mlp, rngs) for _ in range(layers)])
            self.ln = nnx.LayerNorm(dim, rngs=rngs)
            self.head = nnx.Linear(dim, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            import jax.numpy as jnp

            h = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[-1]))
            mask = nnx.make_causal_mask(tokens)
            for block in self.blocks:
                h = block(h, mask)
            return self.head(self.ln(h))

    CharLM.Block = Block  # the block class: what remat= and pipeline= name
    return CharLM


def char_loss_fn(model, batch):
    """Mean next-character cross-entropy. The batch is an argument of the differentiated
    function (not a closure): the 1F1B schedules cut it into microbatches."""
    import optax

    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train_step(model, optimizer, batch):
    from flax import nnx

    loss, grads = nnx.value_and_grad(char_loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def decoder_module():
    """``examples/decoder.py``."""
    return sibling("decoder")


def decoder_train_step(model, optimizer, batch):
    from flax import nnx

    loss, grads = nnx.value_and_grad(decoder_module().loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's command line: see ``examples/options.py``."""
    return _options.parse_args(argv, description=__doc__)


def build_strategy(args: argparse.Namespace, devices, block_cls=None, rules=None, **kwargs):
    """The preset named by ``--strategy``: see ``examples/options.py``."""
    return _options.build_strategy(args, devices, block_cls, rules=rules, **kwargs)


def aot_step(argv: list[str], *, devices):
    """For ``python -m dtensor.aot``: this script's strategy over ``devices``, its train
    step, and the step's arguments, abstract (nothing is allocated)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    args = parse_args(argv)
    decoder = decoder_module() if args.model_size in DECODER_SIZES else None
    rules = None
    if decoder is not None:
        rules = decoder.tensor_rules(decoder.CONFIGS[args.model_size].replace(scan=args.scan))
    block = decoder.Block if decoder else make_model_cls().Block
    strategy, changes, applied = build_strategy(
        args, devices, block, rules=rules, decoder=decoder is not None
    )
    LAST_OPTIONS.clear()
    LAST_OPTIONS.update(applied)
    for option, how in applied.items():
        print(f"{option}: {how}")
    if args.batch_size % strategy.num_replicas_in_sync:
        raise ValueError(
            f"--batch-size {args.batch_size} does not divide over the {strategy.num_replicas_in_sync} "
            f"replicas of {args.strategy} on {len(devices)} devices; pass a multiple of it."
        )
    if decoder is not None:
        cfg = decoder.CONFIGS[args.model_size].replace(scan=args.scan, **changes)
        seq = args.seq_len or 1024

        def build():
            model = decoder.Decoder(cfg, rngs=nnx.Rngs(args.seed))
            return model, nnx.Optimizer(
                model, optax.adamw(args.lr, weight_decay=0.01), wrt=nnx.Param
            )

        step = decoder_train_step
    else:
        dim, layers, heads, mlp, seq = SIZES[args.model_size]
        seq = args.seq_len or seq
        CharLM = make_model_cls()

        def build():
            model = CharLM(dim, layers, heads, mlp, seq, rngs=nnx.Rngs(args.seed))
            return model, nnx.Optimizer(
                model, optax.adamw(args.lr, weight_decay=0.01), wrt=nnx.Param
            )

        step = train_step

    model, optimizer = nnx.eval_shape(build)
    batch = {k: jax.ShapeDtypeStruct((args.batch_size, seq), jnp.int32) for k in ("x", "y")}
    return strategy, step, (model, optimizer, batch)


def model_flops(argv: list[str]) -> float | None:
    """For ``python -m dtensor.aot``: one step's model FLOPs (the decoder's; ``None`` else)."""
    args = parse_args(argv)
    if args.model_size not in DECODER_SIZES:
        return None
    decoder = decoder_module()
    return decoder.model_flops(
        decoder.CONFIGS[args.model_size], args.batch_size, args.seq_len or 1024
    )


def search_facts(argv: list[str]) -> dict:
    """For ``python -m dtensor.aot --search``: the model's shapes, one step's model FLOPs and
    the flags this script accepts (``examples/facts.py``)."""
    return sibling("facts").search_facts(parse_args(argv), decoder_module(), SIZES)


# ----------------------------------------------------------------------- main
#: The options of the preset (examples/options.py): the demo applies them, or refuses them.
STRATEGY_OPTIONS = (
    "mixed_precision",
    "remat",
    "remat_policy",
    "no_reshard_after_forward",
    "xla_plan",
    "gather_at_reads",
    "gather_layers",
    "offload_optimizer",
    "data",
    "tensor",
    "expert",
    "context",
    "context_mode",
    "stage",
    "microbatches",
    "schedule",
    "across_slices",
    "attention",
    "loss_chunks",
    "loss_tiling",
)


def training_strategy(args: argparse.Namespace, pretrained, console):
    """The preset the demo trains under, with the options given (``--remat``, ``--stage``...).

    Without options, ``--strategy``'s preset as registered. With them, the same
    strategy ``python -m dtensor.aot`` builds (``examples/options.py``), over this
    run's devices, with the model's block class (the character model's ``Block``,
    or the decoder's under ``--init-from``). An option that does not apply to
    the preset or the model is refused (``ValueError``): none is ignored.
    Returns ``(strategy, pretrained)``, the pretrained config with the model's
    changes (``--attention``, ``--remat`` where the preset has none...).
    """
    import jax

    import strategies

    defaults = vars(parse_args([]))
    given = [o for o in STRATEGY_OPTIONS if getattr(args, o, None) != defaults[o]]
    if args.scan or args.model_remat:
        flag = "--scan" if args.scan else "--model-remat"
        raise ValueError(
            f"{flag} applies to the decoder's ahead-of-time compiles (--model-size "
            f"{'/'.join(DECODER_SIZES[:2])}... under python -m dtensor.aot), not to the model "
            "this script trains; drop it."
        )
    if not given:
        return strategies.from_name(args.strategy), pretrained
    if pretrained is not None:
        decoder = decoder_module()
        block, rules = decoder.Block, decoder.tensor_rules(pretrained)
    else:
        block, rules = make_model_cls().Block, None
    strategy, changes, applied = build_strategy(
        args, jax.devices(), block, rules=rules, decoder=pretrained is not None
    )
    refused = [o for o, how in applied.items() if how == "not available"]
    if refused:
        what = "the decoder" if pretrained is not None else "the character-level model"
        flags = ", ".join("--" + o.replace("_", "-") for o in refused)
        raise ValueError(
            f"{flags}: not available under --strategy {args.strategy} for {what} "
            f"({type(strategy).__name__} does not take it, nor does the model); drop it, or "
            "pick a preset that takes it (python examples/train.py --list-strategies)."
        )
    for option, how in applied.items():
        console.print(f"--{option.replace('_', '-')}: {how}")
    if pretrained is not None and changes:
        pretrained = pretrained.replace(**changes)
    return strategy, pretrained


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.export_hf and not args.init_from:
        print(
            f"--export-hf {args.export_hf}: the character-level demo model has no Hugging Face "
            "architecture (transformers has no class for it), so it cannot be written as a "
            "Hugging Face folder. Fine-tune a Hugging Face checkpoint with --init-from PATH "
            "--export-hf DIR; the demo model's weights are in the run's checkpoints (--out).",
            file=sys.stderr,
        )
        return 2
    import jax

    from dtensor.runtime.platform import default_platforms

    # CPU only on a machine without TPU/GPU device files (a TPU VM never trains on CPU by accident).
    if (platforms := default_platforms()) is not None:
        jax.config.update("jax_platforms", platforms)
    if "DTENSOR_COORDINATOR" not in os.environ:
        jax.config.update("jax_num_cpu_devices", args.devices)
    elif "DTENSOR_DEVICES_PER_PROCESS" not in os.environ:
        # Under dtensor.launch without --devices-per-process: --devices is the job's, split evenly.
        processes = int(os.environ.get("DTENSOR_NUM_PROCESSES", "1"))
        if args.devices % processes:
            print(
                f"--devices {args.devices} does not divide over the {processes} processes "
                f"dtensor.launch started; give a multiple of {processes}, or "
                "dtensor.launch --devices-per-process N.",
                file=sys.stderr,
            )
            return 2
        jax.config.update("jax_num_cpu_devices", args.devices // processes)

    import dtensor

    dtensor.initialize()  # a no-op for one process; wires up dtensor.launch'ed ones

    import optax
    from flax import nnx
    from rich.console import Console
    from rich.panel import Panel
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    import strategies
    from strategies.failure_handling import PreemptionCheckpointHandler, TerminationConfig

    # Tables and progress go to stderr with --json (stdout holds the JSON only) and nowhere with --quiet.
    console = Console(
        quiet=jax.process_index() != 0 or args.quiet or args.json,
        stderr=args.json,
    )
    if args.list_strategies:
        for name, what in strategies.describe_presets():
            console.print(f"[bold]{name:24}[/] {what}")
        return 0

    if args.model_size in DECODER_SIZES:
        console.print(
            f"[red]--model-size {args.model_size} is the decoder for ahead-of-time compiles: python -m dtensor.aot --topology v5e:4x4 --strategy fully_sharded -- examples/train.py --model-size {args.model_size}"
        )
        return 2
    dim, layers, heads, mlp, seq = SIZES[args.model_size]
    seq = args.seq_len or seq
    pretrained = None
    if args.init_from:
        decoder = decoder_module()
        pretrained = decoder.from_hf_config(args.init_from, attention="xla")
    try:
        strategy, pretrained = training_strategy(args, pretrained, console)
    except ValueError as e:
        console.print(f"[red]{e}")
        return 2
    if pretrained is not None:
        dim, layers, heads = pretrained.d_model, pretrained.layers, pretrained.heads
        if pretrained.vocab < VOCAB:
            console.print(
                f"[red]--init-from {args.init_from}: its vocabulary of {pretrained.vocab} does not cover the corpus's {VOCAB} ASCII codes."
            )
            return 2
    if args.batch_size % strategy.num_replicas_in_sync:
        console.print(
            f"[red]--batch-size {args.batch_size} does not divide over {strategy.num_replicas_in_sync} replicas."
        )
        return 2

    text_data, views = sibling("corpus"), sibling("views")
    corpus = text_data.build_corpus()
    data = text_data.encode(corpus)
    console.print(
        Panel.fit(
            f"[bold]{args.strategy}[/] on {jax.device_count()} {jax.devices()[0].platform} devices "
            f"({jax.process_count()} process{'es' if jax.process_count() > 1 else ''}); "
            f"model {args.model_size} (dim {dim}, {layers} layers, {heads} heads, seq {seq}); "
            f"corpus {len(data):,} chars of the Python standard library's docstrings and source",
            title="jax-dtensor demo",
        )
    )

    with strategy.scope():
        if pretrained is not None:
            model = strategy.create(lambda: decoder.Decoder(pretrained, rngs=nnx.Rngs(args.seed)))
            dtensor.checkpoint.load_safetensors(
                args.init_from, model, mapping=decoder.hf_mapping(pretrained)
            )
            console.print(f"loaded the pretrained weights of {args.init_from}")
        else:
            model = make_model_cls()(dim, layers, heads, mlp, seq, rngs=nnx.Rngs(args.seed))
        optimizer = nnx.Optimizer(model, optax.adamw(args.lr, weight_decay=0.01), wrt=nnx.Param)

    from dtensor.core.visualize import device_grid

    console.print(device_grid(strategy.mesh))
    layouts, rules = strategy.variable_layouts(model)
    console.print(
        dtensor.core.text.layouts_table(
            model,
            layouts,
            rules,
            title=f"variable layouts under {args.strategy}",
            width=console.width,
        )
    )
    first = model.blocks[0].mlp.up if pretrained is not None else model.blocks[0].up.kernel
    console.print(dtensor.visualize(first.get_value(), show=False))

    example = text_data.batch_for_step(data, 0, args.batch_size, seq, args.seed)
    report = strategy.explain(train_step, args=(model, optimizer, example))
    console.print(views.explain_summary(report))
    for w in report.warnings[:5]:
        console.print(Text("warning: ", style="yellow") + Text(str(w)))

    from dtensor.checkpoint.storage import resolve

    run_dir = resolve(args.out) / args.strategy  # a local directory, or a gs:// URL kept as one
    ckpt_dir = run_dir / "checkpoints"
    if args.fresh and jax.process_index() == 0 and ckpt_dir.exists():
        ckpt_dir.rmtree()
    if args.fresh and args.local_checkpoints:  # each host's own tier (its process folder)
        shutil.rmtree(
            os.path.join(args.local_checkpoints, f"process_{jax.process_index()}"),
            ignore_errors=True,
        )
    if args.fresh:
        dtensor.barrier("fresh")
    run_dir.mkdir(parents=True, exist_ok=True)
    batches = iter(
        strategy.distribute_datasets_from_function(
            lambda ctx: text_data.windows_dataset(data, seq, args.seed, ctx, args.batch_size)
        )
    )

    def on_preempt() -> None:
        console.print(
            f"[bold yellow]preempted:[/] checkpoint saved at step {handler.total_run_calls} in {ckpt_dir}; run again to resume."
        )
        sys.exit(0)

    handler = PreemptionCheckpointHandler(
        str(ckpt_dir),
        {"model": model, "optimizer": optimizer},
        strategy,
        save_interval_steps=args.save_every or None,
        termination_config=TerminationConfig(exit_fn=on_preempt),
        signals=(signal.SIGTERM, signal.SIGINT),
        data=batches,  # the pipeline's position is saved and restored with model and optimizer
        local_directory=args.local_checkpoints,
        local_interval_steps=args.local_every,
    )
    start = handler.total_run_calls
    if start:
        console.print(
            f"resumed from the checkpoint at step {start} ({handler.restored_from_tier} tier); "
            f"global batch {args.batch_size} over {jax.device_count()} devices "
            f"({args.batch_size // max(1, jax.device_count())} a device) on "
            f"{jax.process_count()} process(es)"
        )
    if start >= args.steps:
        console.print(
            f"already trained {start} steps; pass --steps N (> {start}) to go on, or --fresh to start over."
        )

    losses: list[tuple[int, float]] = []
    pending: list[tuple[int, object]] = []
    tokens_per_step = args.batch_size * seq
    columns = [
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    t0 = time.perf_counter()
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=args.steps, completed=start, loss="-", tps="-")
        for step in range(start, args.steps):
            batch = next(batches)
            loss = handler.run(
                strategy.run, train_step, args=(model, optimizer, batch), cache_graph=True
            )
            pending.append((step + 1, loss))
            if len(pending) >= 10 or step + 1 == args.steps:
                for s, v in pending:
                    losses.append((s, float(v)))
                pending.clear()
                elapsed = time.perf_counter() - t0
                progress.update(
                    task,
                    completed=step + 1,
                    loss=f"{losses[-1][1]:.3f}",
                    tps=f"{tokens_per_step * (step + 1 - start) / elapsed:,.0f}",
                )
            else:
                progress.update(task, completed=step + 1)
    handler.save()
    handler.close()
    if args.export_hf:  # every process: the save is a collective
        written = sibling("hf").save_hf_folder(
            args.export_hf, model, pretrained, like=args.init_from
        )
        console.print(
            f"wrote the fine-tuned model as a Hugging Face folder: {args.export_hf} "
            f"(config.json, {os.path.basename(written)})"
        )

    if losses and jax.process_index() == 0:
        png = run_dir / "loss.png"
        views.plot_losses(
            losses, png, f"{args.strategy}: char-level LM on {jax.device_count()} devices"
        )
        console.print(f"loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}; curve in {png}")
    sample = views.generate(
        model,
        "def ",
        args.sample_chars,
        seq,
        args.seed,
        encode=text_data.encode,
        decode=text_data.decode,
    )
    console.print(Panel(sample, title="a sample from the model"))
    if jax.process_index() == 0:
        summary = {
            "strategy": args.strategy,
            "devices": jax.device_count(),
            "processes": jax.process_count(),
            "local_devices": jax.local_device_count(),
            "steps": args.steps,
            "resumed_from": start,
            "restored_from_tier": handler.restored_from_tier,
            "global_batch": args.batch_size,
            "loss_first": losses[0][1] if losses else None,
            "loss_last": losses[-1][1] if losses else None,
            "seconds": round(time.perf_counter() - t0, 3),
            "comm_bytes_per_device": report.comm_bytes_per_device,
            "min_comm_bytes_per_device": report.min_comm_bytes_per_device,
            "state_bytes_per_device": report.state_bytes_per_device,
            "checkpoints": str(ckpt_dir),
            "init_from": args.init_from,
            "export_hf": args.export_hf,
            "sample": sample,
        }
        (run_dir / "results.json").write_text(json.dumps(summary, sort_keys=True, indent=1))
        if args.json:
            print(json.dumps(summary, sort_keys=True))
        elif args.quiet:
            first, last = summary["loss_first"], summary["loss_last"]
            loss = f"loss {first:.3f} -> {last:.3f}" if losses else "no steps run"
            print(
                f"{args.strategy}: {args.steps} steps on {jax.device_count()} devices, {loss}, {summary['seconds']:.1f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
