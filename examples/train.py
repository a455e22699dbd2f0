"""Train a character-level Flax NNX transformer under any preset: the main demo.

    python examples/train.py                       # mirrored, 8 simulated CPU devices
    python examples/train.py --strategy fully_sharded
    python examples/train.py --list-strategies
    python -m dtensor.launch -n 2 -- python examples/train.py --strategy multi_worker_mirrored
    python -m dtensor.aot --topology v5e:4x4 --strategy fully_sharded -- examples/train.py \
        --model-size 7b --batch-size 16 --seq-len 1024 --mixed-precision bf16 --remat

The corpus is built at run time from the Python standard library's own
docstrings and source (nothing is downloaded) and read through a Grain
pipeline, each process reading its share of every batch. The run shows the
mesh and every variable's layout, a progress bar, the compiled step's
communication and memory, checkpoints through the preemption handler (Ctrl-C
or SIGTERM saves model, optimizer and the pipeline's position, and exits;
running again resumes all three), a loss curve and a generated sample.

``--out`` takes a directory or a bucket URL: with ``--out gs://BUCKET/run``
the checkpoints, the loss curve and ``results.json`` live in the bucket (try it
without a cloud account against ``gcp-storage-emulator``; see the README).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import sys
import sysconfig
import time
from pathlib import Path

SIZES = {
    #         dim, layers, heads, mlp, seq   (the character-level demo model)
    "demo": (64, 2, 4, 256, 64),
    "small": (128, 4, 4, 512, 128),
    "medium": (256, 6, 8, 1024, 256),
}
VOCAB = 128  # ASCII; anything else becomes '?'
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
)
#: How the last aot_step applied --mixed-precision / --remat / ... (read by benchmarks).
LAST_OPTIONS: dict[str, str] = {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--strategy", default="mirrored", help="a preset name (see --list-strategies)")
    p.add_argument("--list-strategies", action="store_true", help="list the presets and exit")
    p.add_argument("--steps", type=int, default=1000, help="total training steps (default 1000)")
    p.add_argument(
        "--model-size",
        choices=[*SIZES, *DECODER_SIZES],
        default="demo",
        help="demo/small/medium: the character-level model; tiny, 2b, 7b (Gemma), gemma3-12b, "
        "llama2-7b, llama2-70b (and tiny-gemma3, tiny-llama): the decoder of examples/decoder.py, "
        "for python -m dtensor.aot (its aot_step; the large ones are only ever built abstractly)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
    p.add_argument(
        "--seq-len", type=int, default=None, help="sequence length (default: the size's)"
    )
    p.add_argument(
        "--mixed-precision",
        choices=["none", "bf16"],
        default="none",
        help="bf16: float32 variables, bfloat16 reads (strategies.MixedPrecision where the preset "
        "takes it, else the decoder casts its weight reads)",
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
        "--model-remat",
        action="store_true",
        help="with --remat: the decoder's own nnx.remat per block instead of the preset's remat=(Block,)",
    )
    p.add_argument(
        "--offload-optimizer", action="store_true", help="FSDP: optimizer state in host memory"
    )
    p.add_argument("--scan", action="store_true", help="decoder: run the layers with nnx.scan")
    p.add_argument(
        "--remat-policy",
        default=None,
        help="with --remat: a jax.checkpoint_policies name (e.g. dots_saveable); default: save only block inputs",
    )
    p.add_argument(
        "--tensor",
        type=int,
        default=None,
        help="hybrid: the tensor-parallel size (the rest of the devices go to fsdp; the decoder's "
        "Megatron rules); default: the registry's data x fsdp x tensor",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices when no accelerator is present")
    p.add_argument("--out", default="runs", help="where checkpoints, the plot and results go: a directory or a gs:// URL")
    p.add_argument("--save-every", type=int, default=250, help="also checkpoint every N steps (0: only on preemption)")
    p.add_argument("--fresh", action="store_true", help="ignore (delete) earlier checkpoints of this run")
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
    return p.parse_args(argv)


# ----------------------------------------------------------------------- data
def build_corpus(max_chars: int = 1_500_000) -> str:
    """Docstrings, then source, of the standard library's modules (sorted, so the same everywhere)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.glob("*.py") if not f.name.startswith("_"))
    docs: list[str] = []
    sources: list[str] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append(doc.strip() + "\n\n")
        sources.append(text)
    corpus = "".join(docs)
    for text in sources:
        if len(corpus) >= max_chars:
            break
        corpus += text
    return corpus[:max_chars]


def encode(text: str):
    import numpy as np

    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)
    return np.minimum(codes, VOCAB - 1).astype(np.int32)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("ascii", errors="replace")


def windows_dataset(data, seq: int, seed: int, ctx, global_batch: int):
    """This process's share of the batches: a Grain pipeline of shuffled windows of the corpus.

    Index-based (a shuffled ``MapDataset`` of window starts, repeated), so its
    position is saved with each checkpoint and a run resumes on the very next
    batch, even on another number of processes.
    """
    import grain
    import numpy as np

    def window(start) -> dict:
        w = data[int(start) : int(start) + seq + 1]
        return {"x": w[:-1], "y": w[1:]}

    rows = ctx.get_per_pipeline_batch_size(global_batch)
    starts = grain.MapDataset.range(len(data) - seq - 1).shuffle(seed=seed).repeat()
    share = starts[ctx.input_pipeline_id :: ctx.num_input_pipelines].map(window)
    return share.batch(rows, batch_fn=lambda xs: {k: np.stack([x[k] for x in xs]) for k in xs[0]})


def batch_for_step(data, step: int, batch: int, seq: int, seed: int):
    """The batch of a step: random windows chosen by the step number (resumes reproduce it)."""
    import numpy as np

    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    windows = np.stack([data[s : s + seq + 1] for s in starts])
    return {"x": windows[:, :-1], "y": windows[:, 1:]}


# ---------------------------------------------------------------------- model
def make_model_cls():
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

    return CharLM


def train_step(model, optimizer, batch):
    import optax
    from flax import nnx

    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def decoder_module():
    """``examples/decoder.py``, imported once (this script may itself be loaded from a path)."""
    import importlib.util

    name = "_dtensor_example_decoder"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parent / "decoder.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def decoder_train_step(model, optimizer, batch):
    from flax import nnx

    loss, grads = nnx.value_and_grad(decoder_module().loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def build_strategy(args: argparse.Namespace, devices, block_cls=None, rules=None):
    """The preset named by ``--strategy`` over ``devices``, with the options it takes
    (``rules``: the model's tensor-parallel rules, for ``hybrid`` with ``--tensor`` > 1).

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
    decoder = block_cls is not None
    if args.mixed_precision == "bf16":
        if accepts(cls, "mixed_precision") and hasattr(strategies, "MixedPrecision"):
            wanted["mixed_precision"] = strategies.MixedPrecision(
                param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32
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
        if accepts(cls, "remat") and decoder and not args.model_remat:
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
    if hybrid and (args.tensor or decoder):
        tensor = args.tensor or 1
        if len(devices) % tensor:
            raise ValueError(
                f"--tensor {tensor} does not divide the {len(devices)} devices; pass a divisor of it."
            )
        extra: dict[str, object] = {"rules": rules} if rules is not None and tensor > 1 else {}
        if "offload_optimizer" in wanted:
            applied["offload_optimizer"] = "not available"
            wanted.pop("offload_optimizer")
        strategy = cls(
            1,
            len(devices) // tensor,
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
    strategy, changes, applied = build_strategy(
        args, devices, decoder.Block if decoder else None, rules=rules
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


# ---------------------------------------------------------------------- views
def explain_summary(report):
    from rich.table import Table

    from dtensor.core.text import human_bytes

    table = Table(title="the compiled train step (explain)")
    table.add_column("collective")
    table.add_column("mesh axes")
    table.add_column("count", justify="right")
    table.add_column("bytes / device", justify="right")
    rows: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for c in report.collectives:
        key = (c.kind, tuple(c.mesh_axes))
        acc = rows.setdefault(key, [0, 0.0])
        acc[0] += c.count
        acc[1] += c.total_bytes_per_device
    for (kind, axes), (count, nbytes) in sorted(rows.items()):
        table.add_row(kind, ",".join(axes) or "-", str(int(count)), human_bytes(nbytes))
    if not rows:
        table.add_row("none", "-", "0", "0 B")
    ratio = report.comm_ratio
    table.caption = (
        f"communication {human_bytes(report.comm_bytes_per_device)} / device "
        f"(theoretical minimum {human_bytes(report.min_comm_bytes_per_device)}, ratio {ratio:.2f}); "
        f"state {human_bytes(report.state_bytes_per_device)} / device "
        f"(ideal {human_bytes(report.ideal_state_bytes_per_device)}); "
        f"arguments {human_bytes(report.argument_bytes_per_device or 0)}, "
        f"temporaries {human_bytes(report.temp_bytes_per_device or 0)} / device"
    )
    return table


def plot_losses(losses: list[tuple[int, float]], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps, values = zip(*losses, strict=True)
    ax.plot(steps, values)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / char)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    path.write_bytes(buf.getvalue())  # a local path or an object in a bucket


def generate(model, prompt: str, chars: int, seq: int, seed: int) -> str:
    """Sample from a host copy of the model (one device), a window of ``seq`` chars at a time."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    graphdef, state = nnx.split(model)
    host = nnx.merge(graphdef, jax.device_get(state))

    @nnx.jit
    def next_logits(m, window):
        return m(window[None])[0, -1]

    tokens = list(encode(prompt))
    key = jax.random.key(seed)
    for _ in range(chars):
        window = ([ord(" ")] * seq + tokens)[-seq:]
        logits = next_logits(host, jnp.asarray(window, jnp.int32))
        key, sub = jax.random.split(key)
        tokens.append(int(jax.random.categorical(sub, logits / 0.8)))
    return decode(np.asarray(tokens))


# ----------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu" if not _has_accelerator() else "")
    import jax

    launched = "DTENSOR_COORDINATOR" in os.environ
    if not launched:
        jax.config.update("jax_num_cpu_devices", args.devices)

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
    strategy = strategies.from_name(args.strategy)
    dim, layers, heads, mlp, seq = SIZES[args.model_size]
    seq = args.seq_len or seq
    if args.batch_size % strategy.num_replicas_in_sync:
        console.print(
            f"[red]--batch-size {args.batch_size} does not divide over {strategy.num_replicas_in_sync} replicas."
        )
        return 2

    corpus = build_corpus()
    data = encode(corpus)
    console.print(
        Panel.fit(
            f"[bold]{args.strategy}[/] on {jax.device_count()} {jax.devices()[0].platform} devices "
            f"({jax.process_count()} process{'es' if jax.process_count() > 1 else ''}); "
            f"model {args.model_size} (dim {dim}, {layers} layers, {heads} heads, seq {seq}); "
            f"corpus {len(data):,} chars of the Python standard library's docstrings and source",
            title="jax-dtensor demo",
        )
    )

    CharLM = make_model_cls()
    with strategy.scope():
        model = CharLM(dim, layers, heads, mlp, seq, rngs=nnx.Rngs(args.seed))
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
    console.print(dtensor.visualize(model.blocks[0].up.kernel.get_value(), show=False))

    example = batch_for_step(data, 0, args.batch_size, seq, args.seed)
    report = strategy.explain(train_step, args=(model, optimizer, example))
    console.print(explain_summary(report))
    for w in report.warnings[:5]:
        console.print(Text("warning: ", style="yellow") + Text(str(w)))

    from dtensor.checkpoint.storage import resolve

    run_dir = resolve(args.out) / args.strategy  # a local directory, or a gs:// URL kept as one
    ckpt_dir = run_dir / "checkpoints"
    if args.fresh and jax.process_index() == 0 and ckpt_dir.exists():
        ckpt_dir.rmtree()
    if args.fresh:
        dtensor.barrier("fresh")
    run_dir.mkdir(parents=True, exist_ok=True)
    batches = iter(
        strategy.distribute_datasets_from_function(
            lambda ctx: windows_dataset(data, seq, args.seed, ctx, args.batch_size)
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
    )
    start = handler.total_run_calls
    if start:
        console.print(f"resumed from the checkpoint at step {start}")
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
            loss = handler.run(strategy.run, train_step, args=(model, optimizer, batch), cache_graph=True)
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

    if losses and jax.process_index() == 0:
        png = run_dir / "loss.png"
        plot_losses(losses, png, f"{args.strategy}: char-level LM on 8 devices")
        console.print(f"loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}; curve in {png}")
    sample = generate(model, "def ", args.sample_chars, seq, args.seed)
    console.print(Panel(sample, title="a sample from the model"))
    if jax.process_index() == 0:
        summary = {
            "strategy": args.strategy,
            "devices": jax.device_count(),
            "processes": jax.process_count(),
            "steps": args.steps,
            "resumed_from": start,
            "loss_first": losses[0][1] if losses else None,
            "loss_last": losses[-1][1] if losses else None,
            "seconds": round(time.perf_counter() - t0, 3),
            "comm_bytes_per_device": report.comm_bytes_per_device,
            "min_comm_bytes_per_device": report.min_comm_bytes_per_device,
            "state_bytes_per_device": report.state_bytes_per_device,
            "checkpoints": str(ckpt_dir),
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


def _has_accelerator() -> bool:
    # TPU VMs expose /dev/accel* (v2-v4) or /dev/vfio/<n> (v5e, v5p, v6e); without one, JAX_PLATFORMS=cpu
    # keeps libtpu from probing (and printing its TPU_WORKER_HOSTNAMES error) on a machine with no TPU.
    tpu = any(Path("/dev").glob("accel[0-9]*")) or any(Path("/dev/vfio").glob("[0-9]*"))
    return bool(os.environ.get("CUDA_VISIBLE_DEVICES")) or Path("/dev/nvidia0").exists() or tpu


if __name__ == "__main__":
    sys.exit(main())
