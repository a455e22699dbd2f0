"""``strategy.run`` against hand-written ``jax.jit`` with the same shardings, per preset.

Both run the same NNX train step (value_and_grad + Adam) on the same model and
pre-placed global batch. The hand-written version is what a user would write
without the library: ``nnx.split`` once, ``jax.jit`` of a pure step with
``in_shardings``/``out_shardings`` taken from the strategy's own variable and
batch layouts, donated state. Rounds interleave the two (alternating which
goes first); each round gives one ratio ``run / jit`` of seconds per step, and
the table shows min / median / max over the rounds.

For ``fully_sharded`` the two programs differ: the preset gathers each
parameter at its read (reduce-scattered gradients), while plain ``jax.jit``
leaves the plan to XLA; its ratio measures that plan, not dispatch. The row
``fully_sharded_xla_plan`` (``FullyShardedStrategy(gather_at_read=False)``)
compiles the same program as the hand-written jit, so it measures dispatch.

    python -m benchmarks.overhead [--rounds 7] [--steps 20] [--hidden 2048] [--batch 256]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import common


def handwritten(strategy: Any, model: Any, opt: Any, step: Any, batch: Any) -> Any:
    """A ``jax.jit`` step over ``nnx.split`` state, shardings from the strategy's layouts."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split((model, opt))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    batch_shardings = jax.tree.map(lambda x: x.sharding, batch)

    def pure(state: Any, batch: Any) -> Any:
        m, o = nnx.merge(graphdef, state)
        loss = step(m, o, batch)
        return nnx.state((m, o)), loss

    jitted = jax.jit(
        pure,
        in_shardings=(shardings, batch_shardings),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    box = {"state": state}

    def run() -> Any:
        box["state"], loss = jitted(box["state"], batch)
        return loss

    return run


def _strategy(preset: str) -> Any:
    import strategies

    if preset == "fully_sharded_xla_plan":
        return strategies.FullyShardedStrategy(min_shard_bytes=0, gather_at_read=False)
    return strategies.from_name(preset)


def measure(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    import jax

    import dtensor

    step = common.train_step("mlp")
    host_batch = common.mlp_batch(args.batch, args.features, args.features)
    factory = common.mlp_model(args.features, args.hidden, args.features)

    s_run = _strategy(preset)
    m1, o1 = common.build(s_run, factory)
    batch = {k: dtensor.copy_to_mesh(v, s_run.batch_layout(v.ndim)) for k, v in host_batch.items()}
    s_run.run(step, args=(m1, o1, batch))  # places the variables, compiles
    try:
        s_jit = _strategy(preset)
        m2, o2 = common.build(s_jit, factory)
        s_jit.run(step, args=(m2, o2, batch))  # the same placement as the strategy's
        baseline = handwritten(s_jit, m2, o2, step, batch)
        jax.block_until_ready(baseline())  # compile
    except Exception as err:  # noqa: BLE001 - recorded, not fatal
        return {
            "preset": preset,
            "error": f"hand-written jit baseline failed: {type(err).__name__}: {err}"[:300],
        }

    m3, o3 = common.build(s_run, factory)

    def run() -> Any:
        return s_run.run(step, args=(m1, o1, batch))

    def run_cached() -> Any:
        return s_run.run(step, args=(m3, o3, batch), cache_graph=True)

    jax.block_until_ready(run_cached())  # walks the graph once
    ratios, cached_ratios, run_s, cached_s, jit_s = [], [], [], [], []
    for r in range(args.rounds):
        order = [(run, run_s), (run_cached, cached_s), (baseline, jit_s)]
        shift = r % 3
        for fn, sink in order[shift:] + order[:shift]:
            sink.append(common.time_steps(fn, args.steps))
        ratios.append(run_s[-1] / jit_s[-1])
        cached_ratios.append(cached_s[-1] / jit_s[-1])
    return {
        "preset": preset,
        "ratio": common.summary(ratios),
        "cached_ratio": common.summary(cached_ratios),
        "cached_ratios": cached_ratios,
        "run_ms_per_step": common.summary([t * 1e3 for t in run_s]),
        "jit_ms_per_step": common.summary([t * 1e3 for t in jit_s]),
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--presets", default="all")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    common.ensure_devices()
    import strategies

    presets = (
        [*strategies.PRESET_NAMES, "fully_sharded_xla_plan"]
        if args.presets == "all"
        else args.presets.split(",")
    )
    rows = [measure(p, args) for p in presets]
    payload = {
        "settings": {
            k: getattr(args, k) for k in ("features", "hidden", "batch", "rounds", "steps")
        },
        "results": rows,
    }
    path = common.write_json("overhead", payload, args.out)
    table = []
    for r in rows:
        if "error" in r:
            table.append((r["preset"], "-", "-", "-", "-", "-", "-", r["error"][:60]))
        else:
            q = r["ratio"]
            table.append(
                (
                    r["preset"],
                    r["run_ms_per_step"]["median"],
                    r["jit_ms_per_step"]["median"],
                    q["min"],
                    q["median"],
                    q["max"],
                    r["cached_ratio"]["median"],
                    "",
                )
            )
    common.print_table(
        f"strategy.run / hand-written jax.jit, per step ({path.name})",
        [
            "preset",
            "run ms",
            "jit ms",
            "ratio min",
            "ratio median",
            "ratio max",
            "cache_graph median",
            "note",
        ],
        table,
    )
    return payload


if __name__ == "__main__":
    main()
