"""Write the tutorial notebooks (01..04) from the cells below, without outputs.

    .venv/bin/python notebooks/make_notebooks.py

The notebooks are generated so they can be reviewed as code and regenerated
after an edit here; tests/test_notebooks.py executes each one end to end.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
import os

os.environ["JAX_PLATFORMS"] = "cpu"  # 8 simulated CPU devices, whatever this machine has
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX operation
"""


def md(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str) -> nbformat.NotebookNode:
    return new_code_cell(textwrap.dedent(text).strip())


def setup(text: str) -> nbformat.NotebookNode:
    """The first cell: simulated devices before JAX starts, then ``text``."""
    return new_code_cell(SETUP + "\n" + textwrap.dedent(text).strip())


# --------------------------------------------------------------------- 01
LAYOUTS = [
    md("""
    # 01 · Meshes and layouts

    The DTensor model in a few cells: a **mesh** names the devices' axes, a
    **layout** says, for each dimension of an array, which mesh axis splits it
    (or `UNSHARDED`). Everything else — relayout, pack/unpack, rules for whole
    parameter trees, collectives — is built on those two values.

    This notebook runs on 8 simulated CPU devices; the first cell asks for them
    before JAX starts.
    """),
    setup("""
    import jax.numpy as jnp
    import numpy as np

    import dtensor
    from dtensor import UNSHARDED

    jax.devices()
    """),
    md("""
    ## Meshes

    `create_mesh` takes `(name, size)` pairs, outermost first; one size may be
    `-1` (whatever the device count leaves). A mesh is a small immutable value
    that compiles to a `jax.sharding.Mesh` (`.jax_mesh`).
    """),
    code("""
    mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
    print(mesh, mesh.dim_names, mesh.shape, mesh.size)
    print(mesh.devices)  # device ids in mesh order: rows are 'batch', columns 'model'
    print(dtensor.create_mesh([("data", -1), ("model", 2)]))
    """),
    md("""
    **Auto vs Explicit axes.** By default the axes are JAX's *Auto* type: the
    compiler chooses intermediate shardings, and ordinary Flax/optax code runs
    unchanged. *Explicit* axes make sharding part of each array's type (needed
    by models whose layers pass `out_sharding=`). The two are different meshes,
    so layouts over them differ too.
    """),
    code("""
    explicit = dtensor.create_mesh([("batch", 4), ("model", 2)], axis_types="explicit")
    print(explicit, explicit.axis_types, mesh.axis_types)
    print("same mesh?", explicit == mesh)
    """),
    md("""
    ## Layouts

    One spec per array dimension. A `Layout` compiles to a `PartitionSpec` and
    a `NamedSharding`, and knows the block each device holds.
    """),
    code("""
    layout = dtensor.Layout(["batch", UNSHARDED], mesh)
    print(layout)
    print(layout.partition_spec, "|", layout.sharding)
    print("shards per dim:", layout.num_shards(0), layout.num_shards(1))
    print("block of an (8, 16) array on each device:", layout.local_shape((8, 16)))
    print("fully replicated?", layout.is_fully_replicated())
    """),
    md("""
    Shortcuts for the common cases, and a text form that round-trips (handy in
    logs, configs and checkpoint manifests):
    """),
    code("""
    print(dtensor.Layout.batch_sharded(mesh, "batch", rank=3))
    print(dtensor.Layout.replicated(mesh, rank=2))
    print(dtensor.Layout.inner_sharded(mesh, "model", rank=2))
    both = dtensor.Layout([("batch", "model"), UNSHARDED], mesh)  # dim 0 split over all 8 devices
    text = both.to_string()
    print(text)
    assert dtensor.Layout.from_string(text) == both
    """),
    md("""
    ## Who holds what

    `Layout.visualize(shape)` draws the blocks of an array of that shape and the
    devices holding each one. Here a `(8, 16)` matrix: rows split over `batch`,
    columns over `model` — each block lives on exactly one device.
    """),
    code("""
    dtensor.Layout(["batch", "model"], mesh).visualize(shape=(8, 16));
    """),
    md("""
    Leave a dimension `UNSHARDED` and the devices along the unused mesh axis
    hold **copies** of the same block (here pairs of devices along `model`):
    """),
    code("""
    dtensor.Layout(["batch", UNSHARDED], mesh).visualize(shape=(8, 16));
    """),
    md("""
    ## Arrays in a layout

    `copy_to_mesh` places host data; `fetch_layout` reads an array's layout
    back; `dtensor.visualize(x)` draws a real array.
    """),
    code("""
    x = dtensor.copy_to_mesh(np.arange(8 * 16, dtype=np.float32).reshape(8, 16), layout)
    print(dtensor.fetch_layout(x))
    print("one device's block:", x.addressable_shards[0].data.shape)
    dtensor.visualize(x);
    """),
    md("""
    ## Relayout

    `relayout` moves data between layouts: eagerly it transfers blocks (XLA
    picks the collectives); inside `jax.jit` it is a sharding constraint on the
    value. The values never change, only where they live.
    """),
    code("""
    y = dtensor.relayout(x, dtensor.Layout([UNSHARDED, "model"], mesh))
    print(dtensor.fetch_layout(y))
    assert (np.asarray(y) == np.asarray(x)).all()


    @jax.jit
    def scale_then_split_columns(a):
        b = 2 * a
        return dtensor.relayout(b, dtensor.Layout(["batch", "model"], mesh))  # a constraint here


    z = scale_then_split_columns(x)
    print(dtensor.fetch_layout(z))
    dtensor.visualize(z);
    """),
    md("""
    ## pack / unpack

    The per-device view. `unpack` returns each local device's block in mesh
    order; `pack` assembles a global array from such blocks (devices that hold
    copies of a block must be given equal copies — it checks).
    """),
    code("""
    blocks = dtensor.unpack(x)
    print(len(blocks), "blocks of shape", blocks[0].shape)
    print("device 2's block starts with row", int(blocks[2][0, 0]) // 16)

    row_layout = dtensor.Layout([("batch", "model"), UNSHARDED], mesh)  # one row per device
    packed = dtensor.pack([np.full((1, 3), i, np.float32) for i in range(8)], row_layout)
    print(packed)
    """),
    md("""
    ## Creating arrays directly in a layout

    `call_with_layout(fn, layout, *args)` runs `fn` under `jax.jit` with the
    output sharding set, so each device computes only its own block — a large
    weight is never materialised whole on one device. JAX's random numbers give
    the same values whatever the layout.
    """),
    code("""
    w_layout = dtensor.Layout([UNSHARDED, "model"], mesh)
    w = dtensor.call_with_layout(jax.random.normal, w_layout, jax.random.key(0), (16, 32))
    print(dtensor.fetch_layout(w), [s.data.shape for s in w.addressable_shards][:2])
    assert np.allclose(np.asarray(w), np.asarray(jax.random.normal(jax.random.key(0), (16, 32))))
    """),
    md("""
    ## Layouts for a whole parameter tree: `LayoutMap` + `distribute`

    A `LayoutMap` is an ordered list of regular expressions on pytree paths
    (first match wins, Keras style); unmatched leaves are replicated. It can
    also map Flax-style *logical* axis names onto mesh axes. `distribute`
    places any pytree (dicts, Flax NNX state or modules, Linen params, optax
    state) by it.
    """),
    code("""
    params = {
        "encoder": {"kernel": jnp.ones((16, 64)), "bias": jnp.zeros((64,))},
        "decoder": {"kernel": jnp.ones((64, 16)), "bias": jnp.zeros((16,))},
    }
    rules = dtensor.LayoutMap(
        mesh,
        [("encoder/kernel", (UNSHARDED, "mlp")), ("decoder/kernel", ("mlp", UNSHARDED))],
        logical_axis_rules=[("mlp", "model")],  # the logical name 'mlp' lives on mesh axis 'model'
    )
    print(rules["encoder/kernel"], rules["encoder/bias"])
    placed = dtensor.distribute(params, rules)
    for path, leaf in jax.tree_util.tree_leaves_with_path(placed):
        print(f"{jax.tree_util.keystr(path):28s} {dtensor.fetch_layout(leaf)}")
    """),
    md("""
    The same information as a table (path, shape, layout, the rule that matched,
    bytes per device):
    """),
    code("""
    dtensor.core.text.layouts_table(placed, *dtensor.resolve_layouts(placed, rules))
    """),
    md("""
    ## Collectives over named mesh axes

    On global arrays, by axis name (`jax.shard_map` + `jax.lax` collectives
    underneath). They work on each device's *block*: take a vector of 8
    numbers, one per device along a flat mesh; `all_reduce` combines the eight
    1-element blocks into one, which every device then holds.
    """),
    code("""
    flat = dtensor.create_mesh([("x", 8)])
    v = dtensor.copy_to_mesh(jnp.arange(8.0), dtensor.Layout(["x"], flat))
    print("all_reduce sum :", dtensor.all_reduce(v, "x"))
    print("all_reduce max :", dtensor.all_reduce(v, "x", dtensor.ReduceOp.MAX))
    print("all_gather     :", dtensor.all_gather(v, "x"), dtensor.fetch_layout(dtensor.all_gather(v, "x")))
    print("broadcast from 3:", dtensor.broadcast(v, "x", source=3))
    ones = dtensor.copy_to_mesh(jnp.ones(8), dtensor.Layout.replicated(flat, 1))
    rs = dtensor.reduce_scatter(ones, "x")  # 8 copies summed, then split: each device keeps one 8.0
    print("reduce_scatter :", rs, dtensor.fetch_layout(rs))
    """),
    md("""
    On the 2-D mesh a collective reduces only along the axes you name; the
    other axis keeps its blocks apart:
    """),
    code("""
    m = dtensor.copy_to_mesh(jnp.arange(8.0).reshape(4, 2), dtensor.Layout(["batch", "model"], mesh))
    col_sums = dtensor.all_reduce(m, "batch")  # sum over the 4 'batch' blocks of each column
    print(col_sums, dtensor.fetch_layout(col_sums))
    assert np.allclose(np.asarray(col_sums), np.arange(8.0).reshape(4, 2).sum(0))
    """),
    md("""
    ## Mistakes get clear messages

    Every error names the array, the layout, the mesh and the fix:
    """),
    code("""
    for bad in (
        lambda: dtensor.Layout(["batc", UNSHARDED], mesh),
        lambda: dtensor.copy_to_mesh(np.zeros((10, 4)), dtensor.Layout(["batch", UNSHARDED], mesh)),
        lambda: dtensor.create_mesh([("x", 16)]),
    ):
        try:
            bad()
        except ValueError as e:
            print(f"{type(e).__name__}: {e}\\n")
    """),
    md("""
    Next: `02_strategies` uses these pieces through the tf.distribute-style
    presets.
    """),
]


# --------------------------------------------------------------------- 02
STRATEGIES = [
    md("""
    # 02 · One model, every preset

    A strategy is a mesh plus two policies: where each variable goes and where
    each batch goes. Here the *same* Flax NNX model and the *same* train step
    run under every preset in `strategies.PRESET_NAMES`; for each we look at
    the variables' layouts, what `explain` finds in the compiled step
    (collectives, bytes per device against the theoretical minimum, memory),
    and the losses of a few steps — which agree across presets.
    """),
    setup("""
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np
    import optax
    from flax import nnx
    from rich.console import Console
    from rich.table import Table

    import strategies

    print(len(jax.devices()), "devices")
    for name, what in strategies.describe_presets():
        print(f"{name:22s} {what}")
    """),
    md("""
    ## The model and the step

    Ordinary single-device code: an MLP and a train step on the **global**
    batch. Nothing in it mentions devices. (The layer names `up`/`down` are the
    ones the tensor-parallel rules know: column-split `up`, row-split `down`.)
    """),
    code("""
    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(16, 64, rngs=rngs)
            self.down = nnx.Linear(64, 8, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))


    def train_step(model, optimizer, batch):
        def loss_fn(m):
            return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss


    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 8)).astype(np.float32)}
        for _ in range(4)
    ]
    """),
    md("""
    ## Two presets up close

    `describe(model)` prints the mesh and each variable's layout.
    `MirroredStrategy` replicates every variable; `FullyShardedStrategy`
    (ZeRO-3) splits each over all 8 devices.
    """),
    code("""
    for name in ("mirrored", "fully_sharded"):
        strategy = strategies.from_name(name)
        with strategy.scope():  # a model built here comes out in the strategy's layouts
            model = MLP(nnx.Rngs(0))
        text = strategy.describe(model)
        print(text)
        assert "up/kernel" in text
    """),
    md("""
    ## Every preset

    For each preset: build the model and optimizer in its scope, `explain` the
    step (it compiles, nothing runs), then train 4 steps with `run`.
    `experimental_distribute_dataset` splits each global batch over the
    replicas.
    """),
    code("""
    results = {}
    for name in strategies.PRESET_NAMES:
        strategy = strategies.from_name(name)
        with strategy.scope():
            model = MLP(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        report = strategy.explain(train_step, args=(model, optimizer, batches[0]))
        losses = [
            float(strategy.run(train_step, args=(model, optimizer, b)))
            for b in strategy.experimental_distribute_dataset(batches)
        ]
        results[name] = dict(mesh=repr(strategy.mesh), report=report, losses=losses)
        print(f"{name:22s} {results[name]['mesh']:32s} losses {np.round(losses, 4)}")
    """),
    md("""
    The losses agree: every preset computes the same training, only the
    placement differs.
    """),
    code("""
    reference = np.array(results["one_device"]["losses"])
    for name, r in results.items():
        np.testing.assert_allclose(r["losses"], reference, rtol=1e-5, err_msg=name)
    print("all", len(results), "presets match one_device to rtol 1e-5")
    """),
    md("""
    ## What the compiled step costs

    Per device: bytes sent by the step's collectives, the theoretical minimum
    for the layouts used, their ratio, the collectives by kind, and the
    variables' memory (model + optimizer state) against an ideal even split over
    the 8 devices. Data-parallel presets pay one gradient all-reduce and keep
    full copies of the state; sharded presets trade memory for all-gathers.
    """),
    code("""
    def kib(n):
        return f"{n / 1024:.1f}"


    table = Table(title="explain(train_step) per preset, per device")
    for col in ("preset", "mesh", "comm KiB", "min KiB", "comm/min", "collectives", "state KiB", "ideal KiB"):
        table.add_column(col, justify="left" if col in ("preset", "mesh", "collectives") else "right")
    for name, r in results.items():
        rep = r["report"]
        kinds = ", ".join(f"{k} {kib(v)}" for k, v in rep.by_kind().items()) or "-"
        table.add_row(
            name, r["mesh"], kib(rep.comm_bytes_per_device), kib(rep.min_comm_bytes_per_device),
            f"{rep.comm_ratio:.2f}", kinds, kib(rep.state_bytes_per_device), kib(rep.ideal_state_bytes_per_device),
        )
    Console(width=160).print(table)
    """),
    md("""
    `str(report)` has the full story for one preset: every collective with its
    mesh axes and shape, every variable's layout, and warnings (for example
    variables that matched no rule).
    """),
    code("""
    text = str(results["tensor_parallel"]["report"])
    print(text)
    assert "megatron column" in text  # the rule that placed each variable is named
    """),
    md("""
    ## Side by side
    """),
    code("""
    names = list(results)
    reports = [results[n]["report"] for n in names]
    pos = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.5))
    ax1.bar(pos - 0.2, [r.comm_bytes_per_device / 1024 for r in reports], 0.4, label="compiled")
    ax1.bar(pos + 0.2, [r.min_comm_bytes_per_device / 1024 for r in reports], 0.4, label="theoretical minimum")
    ax1.set_title("communication per device per step (KiB)")
    ax2.bar(pos - 0.2, [r.state_bytes_per_device / 1024 for r in reports], 0.4, label="in its layouts")
    ax2.bar(pos + 0.2, [r.ideal_state_bytes_per_device / 1024 for r in reports], 0.4, label="split evenly")
    ax2.set_title("model + optimizer state per device (KiB)")
    for ax in (ax1, ax2):
        ax.set_xticks(pos, names, rotation=45, ha="right")
        ax.legend()
    fig.tight_layout()
    plt.show()
    """),
    md("""
    Next: `03_checkpoint_preemption` saves under one preset and restores under
    another.
    """),
]


# --------------------------------------------------------------------- 03
TRAIN_SCRIPT = '''\
"""Train an MLP under MirroredStrategy with a PreemptionCheckpointHandler.

Usage: train.py CKPT_DIR OUT.npz [--wait-at-step K]
"""
import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
import jax

jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import strategies
from strategies.failure_handling import PreemptionCheckpointHandler

TOTAL_STEPS = 12
ckpt_dir, out_path = sys.argv[1], sys.argv[2]
wait_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
    optimizer.update(model, grads)
    return loss


rng = np.random.default_rng(0)
data = [
    {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 8)).astype(np.float32)}
    for _ in range(TOTAL_STEPS)
]
strategy = strategies.MirroredStrategy()
with strategy.scope():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

# Restores the latest checkpoint if there is one; total_run_calls = steps already done.
handler = PreemptionCheckpointHandler(ckpt_dir, {"model": model, "optimizer": optimizer}, strategy)
print("START at step", handler.total_run_calls, flush=True)


def one_step():
    step = handler.total_run_calls  # the data follow the step count, so a resumed run continues exactly
    loss = strategy.run(train_step, args=(model, optimizer, data[step]))
    if step == wait_at:  # for the demo: this step lasts until the signal arrives
        print("WAITING in step", step + 1, flush=True)
        deadline = time.monotonic() + 60
        while not handler.preemption_noticed and time.monotonic() < deadline:
            time.sleep(0.01)
    return loss


while handler.total_run_calls < TOTAL_STEPS:
    loss = handler.run(one_step)  # on SIGTERM: finish the step, save, exit(143)
    print("STEP", handler.total_run_calls, f"{float(loss):.6f}", flush=True)
handler.close()
np.savez(out_path, **{jax.tree_util.keystr(p): np.asarray(v) for p, v in
                      jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param).to_pure_dict())})
print("DONE", flush=True)
'''

CHECKPOINT = [
    md("""
    # 03 · Checkpoints across layouts, preemption and resume

    `dtensor.checkpoint` saves laid-out arrays, NNX modules and optimizers
    (orbax underneath) with a manifest of their layouts, and restores into
    *another* mesh, device count or strategy — the values are bit-identical.
    `PreemptionCheckpointHandler` builds on it: on SIGTERM it finishes the
    current step, saves, and exits; a restarted job resumes where it stopped.
    """),
    setup("""
    import signal
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import dtensor
    import strategies

    workdir = Path(tempfile.mkdtemp(prefix="dtensor-nb03-"))


    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(16, 64, rngs=rngs)
            self.down = nnx.Linear(64, 8, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))


    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        optimizer.update(model, grads)
        return loss


    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 8)).astype(np.float32)}
        for _ in range(6)
    ]


    def build(strategy, seed):
        with strategy.scope():
            model = MLP(nnx.Rngs(seed))
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        return model, optimizer
    """),
    md("""
    ## Save under `MirroredStrategy` on 8 devices

    Train 3 steps, then save the model and the optimizer (Adam's moments and
    step count included).
    """),
    code("""
    mirrored = strategies.MirroredStrategy()
    model, optimizer = build(mirrored, seed=0)
    for b in batches[:3]:
        mirrored.run(train_step, args=(model, optimizer, b))
    ckpt_dir = workdir / "ckpt"
    step = dtensor.checkpoint.save(ckpt_dir, {"model": model, "optimizer": optimizer}, step=3)
    manifest = dtensor.checkpoint.read_manifest(ckpt_dir)
    print("saved step", step, "from mesh", manifest["mesh"])
    for entry in manifest["leaves"][:4]:  # the manifest records every array's layout as text
        print(f"{entry['path']:20s} {str(entry['shape']):9s} {entry['layout']}")
    """),
    md("""
    ## Restore under `FullyShardedStrategy` on 4 devices, then on one device

    Build a fresh model (another seed, so different values) in the target
    strategy's scope and restore *into* it: each array arrives in the layout
    the live model has — split over 4 devices here, whole on one device below.
    """),
    code("""
    fsdp = strategies.FullyShardedStrategy(jax.devices()[:4], min_shard_bytes=0)
    model4, optimizer4 = build(fsdp, seed=1)
    dtensor.checkpoint.restore(ckpt_dir, {"model": model4, "optimizer": optimizer4})
    print(fsdp.describe(model4))

    one = strategies.OneDeviceStrategy(jax.devices()[0])
    model1, optimizer1 = build(one, seed=2)
    dtensor.checkpoint.restore(ckpt_dir, {"model": model1, "optimizer": optimizer1})
    print(dtensor.fetch_layout(model1.up.kernel.get_value()))
    """),
    md("""
    The values are identical, bit for bit, in all three places — parameters and
    optimizer state alike:
    """),
    code("""
    def values(model, optimizer):
        return [np.asarray(v) for v in jax.tree.leaves(nnx.state((model, optimizer), nnx.Param, nnx.OptState))]


    saved = values(model, optimizer)
    for label, m, o in (("fully_sharded x4", model4, optimizer4), ("one_device", model1, optimizer1)):
        got = values(m, o)
        assert len(got) == len(saved) and all(a.tobytes() == b.tobytes() for a, b in zip(saved, got))
        print(label, "identical:", len(got), "arrays")
    """),
    md("""
    And training continues identically wherever it resumed: the next three
    losses under each strategy.
    """),
    code("""
    for label, s, m, o in (("mirrored x8", mirrored, model, optimizer), ("fully_sharded x4", fsdp, model4, optimizer4),
                           ("one_device", one, model1, optimizer1)):
        losses = [float(s.run(train_step, args=(m, o, b))) for b in batches[3:]]
        print(f"{label:18s} {np.round(losses, 6)}")
    """),
    md("""
    ## Preemption and resume, with a real process

    The training script below (written to a temporary directory) wraps each
    step in `handler.run(...)`. Cloud schedulers announce a preemption with
    SIGTERM; the handler then lets the running step finish, saves a checkpoint
    at that step boundary and exits with status 143 ("restart me"). Started
    again, the handler restores that checkpoint and `total_run_calls` tells the
    loop where to continue.

    To make the demo deterministic the script can hold one step open until the
    signal arrives (`--wait-at-step`).
    """),
    code("""
    script = workdir / "train.py"  # the next cell writes it
    """),
    new_code_cell("%%writefile {script}\n" + TRAIN_SCRIPT),
    code("""

    def start(ckpt, out, *extra):
        return subprocess.Popen([sys.executable, str(script), str(ckpt), str(out), *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


    reference = start(workdir / "ref-ckpt", workdir / "reference.npz")  # an uninterrupted run, alongside
    job = start(workdir / "job-ckpt", workdir / "resumed.npz", "--wait-at-step", "5")
    seen = []
    for line in job.stdout:
        seen.append(line.rstrip())
        if line.startswith("WAITING"):
            job.send_signal(signal.SIGTERM)  # the "preemption", while step 6 is running
    status = job.wait(timeout=120)
    print("\\n".join(l for l in seen if l.startswith(("START", "STEP", "WAITING"))))
    print("exit status:", status)
    assert status == strategies.failure_handling.RESTARTABLE_EXIT_CODE, "\\n".join(seen[-40:])
    """),
    md("""
    Step 6 — the one running when the signal came — finished and was saved;
    nothing after it ran:
    """),
    code("""
    saved_steps = dtensor.checkpoint.Checkpointer(workdir / "job-ckpt").all_steps()
    print("checkpoints:", saved_steps)
    assert saved_steps == [6]
    """),
    md("""
    Run the same command again: it resumes at step 6 and finishes. Its final
    parameters equal the uninterrupted run's exactly.
    """),
    code("""
    resumed = subprocess.run([sys.executable, str(script), str(workdir / "job-ckpt"), str(workdir / "resumed.npz")],
                             capture_output=True, text=True, timeout=120)
    print("\\n".join(l for l in resumed.stdout.splitlines() if l.startswith(("START", "STEP", "DONE"))))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    ref_out, _ = reference.communicate(timeout=120)
    assert reference.returncode == 0, ref_out[-3000:]

    def losses(text):
        return {l.split()[1]: l.split()[2] for l in text.splitlines() if l.startswith("STEP")}


    after_restart = losses(resumed.stdout)
    assert after_restart == {k: v for k, v in losses(ref_out).items() if int(k) > 6}
    print("losses of steps 7-12 equal the uninterrupted run's")
    ref, got = np.load(workdir / "reference.npz"), np.load(workdir / "resumed.npz")
    for name in ref.files:
        assert ref[name].tobytes() == got[name].tobytes(), name
    print("resumed run == uninterrupted run, bit for bit:", sorted(ref.files))
    """),
    md("""
    In a multi-process job (see `04_multi_process`) the handler uses JAX's
    coordination service instead of a local signal handler, so every process
    stops and saves at the *same* step, whichever one was signalled.
    """),
]


# --------------------------------------------------------------------- 04
COMMON = '''\
"""The model, train step and data shared by job.py and the notebook."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
    optimizer.update(model, grads)
    return loss


rng = np.random.default_rng(0)
BATCHES = [
    {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 8)).astype(np.float32)}
    for _ in range(5)
]
'''

JOB = '''\
"""One copy per process: `python -m dtensor.launch -n 2 -- python job.py`."""
import json

import dtensor

dtensor.initialize()  # joins the job (a no-op for a lone process); before any JAX computation

import jax
import numpy as np
import optax
from flax import nnx

import strategies
from common import BATCHES, MLP, train_step

me, n = dtensor.client_id(), dtensor.num_clients()
print(f"process {me} of {n}: {jax.local_device_count()} local devices, {jax.device_count()} in the job")

# A global array over every device of every process; each process supplies its own blocks.
mesh = dtensor.create_mesh([("x", -1)])
local = np.full((jax.local_device_count(),), me + 1.0, np.float32)
x = jax.make_array_from_process_local_data(dtensor.Layout(["x"], mesh).sharding, local)
total = dtensor.all_reduce(x, "x")  # crosses the process boundary (gloo on CPU)
print(f"global shape {x.shape}, my blocks {[float(s.data[0]) for s in x.addressable_shards]}, sum {float(total[0])}")

strategy = strategies.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def my_share(ctx: strategies.InputContext):
    """This process's rows of every global batch of 32."""
    rows = ctx.get_per_pipeline_batch_size(32)
    lo = ctx.input_pipeline_id * rows
    return [{k: v[lo:lo + rows] for k, v in b.items()} for b in BATCHES]


losses = [float(strategy.run(train_step, args=(model, optimizer, b)))
          for b in strategy.distribute_datasets_from_function(my_share)]
if me == 0:
    print(f"mesh {strategy.mesh}, {strategy.num_replicas_in_sync} replicas")
    print("LOSSES", json.dumps(losses))
dtensor.barrier("done")
'''

MULTI_PROCESS = [
    md("""
    # 04 · Many processes: the launcher

    A multi-host job is one copy of the same script per host (per process),
    each driving its own devices; JAX joins them into one set of global
    devices and XLA's collectives cross the process boundary (NCCL on GPU,
    ICI/DCN on TPU, gloo on CPU). `python -m dtensor.launch -n N -- CMD` tries
    exactly that on one machine: it starts N local processes wired to one
    coordinator on 127.0.0.1 and prefixes their output with the rank.
    """),
    setup("""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import numpy as np

    import dtensor

    print("this notebook is process", dtensor.client_id(), "of", dtensor.num_clients())
    workdir = Path(tempfile.mkdtemp(prefix="dtensor-nb04-"))
    """),
    md("""
    ## The code each process runs

    A small module with the model, the train step and the data (the notebook
    uses it too, below):
    """),
    new_code_cell("%%writefile {workdir}/common.py\n" + COMMON),
    md("""
    The job script. `dtensor.initialize()` comes first: under the launcher it
    reads the coordinator address, the process count and its rank from the
    environment; alone it does nothing. The script builds a global array whose
    blocks come from both processes and sums it across them, then trains under
    `MultiWorkerMirroredStrategy`, whose mesh is `(worker, replica)`; each
    process feeds only its own share of every batch
    (`distribute_datasets_from_function`).
    """),
    new_code_cell("%%writefile {workdir}/job.py\n" + JOB),
    md("""
    ## Launch 2 processes × 4 simulated devices

    From a terminal this is `python -m dtensor.launch -n 2 --devices-per-process 4
    -- python job.py`; here both the launcher and the workers use this kernel's
    Python (`sys.executable`).
    """),
    code("""
    cmd = [sys.executable, "-m", "dtensor.launch", "-n", "2", "--devices-per-process", "4", "--timeout", "150",
           "--", sys.executable, "job.py"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=workdir)
    lines = [l for l in run.stdout.splitlines() if "[Gloo]" not in l]  # gloo's connection chatter
    print("\\n".join(lines))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    """),
    md("""
    Every line carries its rank. Process 0 supplied blocks of 1.0 and process 1
    blocks of 2.0, so the sum over the 8 devices is 4×1 + 4×2 = 12, on both.
    """),
    code("""
    sums = [l for l in lines if " sum " in l]
    print("\\n".join(sums))
    assert len(sums) == 2 and all(l.endswith("sum 12.0") for l in sums)
    """),
    md("""
    ## The same training in one process

    The same model, step and data in this notebook: one process with 8
    devices, so `MultiWorkerMirroredStrategy` has a single worker. The losses
    match the two-process job's — the split over processes changes where the
    work happens, not the result.
    """),
    code("""
    import optax
    from flax import nnx

    import strategies

    sys.path.insert(0, str(workdir))
    from common import BATCHES, MLP, train_step

    single = strategies.MultiWorkerMirroredStrategy()
    with single.scope():
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    local_losses = [float(single.run(train_step, args=(model, optimizer, b)))
                    for b in single.experimental_distribute_dataset(BATCHES)]
    job_losses = json.loads(next(l for l in lines if "LOSSES" in l).split("LOSSES", 1)[1])
    print("one process  ", single.mesh, np.round(local_losses, 6))
    print("two processes", np.round(job_losses, 6))
    np.testing.assert_allclose(job_losses, local_losses, rtol=1e-5)
    """),
    md("""
    ## Real clusters, and coming from TensorFlow

    Without the launcher, `dtensor.initialize()` finds the cluster by itself on
    Cloud TPU VMs, SLURM, Open MPI and Kubernetes (JAX's own detection): run the
    same command on every host. Jobs set up for `tf.distribute` keep their
    `TF_CONFIG` JSON; the chief (or else the first worker) is process 0 and
    hosts the coordinator. This is what `initialize()` reads from it:
    """),
    code("""
    from dtensor.runtime import parse_tf_config

    tf_config = {"cluster": {"worker": ["host0:12345", "host1:12345"]}, "task": {"type": "worker", "index": 1}}
    print(parse_tf_config(json.dumps(tf_config)))
    # On each host: TF_CONFIG='{...its own task index...}' python job.py
    """),
]


NOTEBOOKS = {
    "01_layouts.ipynb": LAYOUTS,
    "02_strategies.ipynb": STRATEGIES,
    "03_checkpoint_preemption.ipynb": CHECKPOINT,
    "04_multi_process.ipynb": MULTI_PROCESS,
}


def build(cells: list[nbformat.NotebookNode]) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"c{i:02d}"  # stable ids: regenerating gives the same files
    return nb


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        nb = build(cells)
        nbformat.validate(nb)
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
