"""The demo's views: the explain summary table, the loss curve, a generated sample.

Used by ``examples/train.py``.
"""

from __future__ import annotations


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


def generate(model, prompt: str, chars: int, seq: int, seed: int, *, encode, decode) -> str:
    """Sample from a host copy of the model (one device), a window of ``seq`` chars at a time.

    ``encode``/``decode`` turn text into the model's tokens and back. Every process calls it:
    with several processes the variables span devices another process owns, so each process
    gathers the whole model first (a collective), then samples on its own.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    graphdef, state = nnx.split(model)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        state = multihost_utils.process_allgather(state, tiled=True)
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
