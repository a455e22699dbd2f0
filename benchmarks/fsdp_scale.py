"""FullyShardedStrategy at Gemma 2B / 7B scale, compiled ahead of time for TPU topologies.

    python -m benchmarks.fsdp_scale [--sizes 2b,7b] [--topologies v5e:4x4,v5p:2x2x2] [--out DIR]

For each model size, topology and preset option (the default gather-at-read
plan; ``reshard_after_forward=False``; ``gather_at_read=False``, XLA's own
plan; bfloat16 mixed precision; bfloat16 + remat) the demo's decoder train
step (``examples/train.py --model-size SIZE``, global batch 16 x 1024, AdamW)
is compiled by the TPU compiler (``dtensor.tpu_topology``: no TPU needed),
and, for the tiny decoder, by the CPU compiler over 8 simulated devices. Each
row: XLA's peak per chip, the ideal peak (the ZeRO formula,
``dtensor.analysis.peak``), communication over its minimum, all-gather bytes,
compile seconds, and how each option was applied (by the preset, by the
model when the preset does not take it, or "not available"). Each compile
runs in its own process (a 7B compile holds several GiB). Writes
``benchmarks/results/fsdp_scale.json`` (after every row) and prints the
table and the targets. GPU topologies (``h100:1x8``, :func:`dtensor.gpu_topology`,
compiled by XLA:GPU) write ``benchmarks/results/fsdp_scale_gpu.json`` instead::

    python -m benchmarks.fsdp_scale --sizes 2b --topologies h100:1x8 --cpu-sizes "" \
        --options "default,gather at reads,bf16 + remat,bf16 + remat + gather at reads"
    python -m benchmarks.fsdp_scale --sizes llama2-70b --topologies h100:8x8 --cpu-sizes "" \
        --options "bf16 + remat + scan" --merge
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import common
from .fsdp_tables import (
    BATCH,
    MAXTEXT_GIB,
    MAXTEXT_ORDER,
    MAXTEXT_ROWS,
    OPTION_TEXT,
    compact,
    markdown,
    results_name,
    side_by_side,
    slices_table,
    split_slices,
)

__all__ = [
    "BATCH",
    "MAXTEXT_GIB",
    "MAXTEXT_ROWS",
    "OPTION_TEXT",
    "markdown",
    "measure",
    "results_name",
    "side_by_side",
]

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train.py"

#: option name -> extra train.py arguments
OPTIONS: dict[str, list[str]] = {
    "default": [],
    "gather at reads": ["--gather-at-reads"],
    "gather at reads, reshard off": ["--gather-at-reads", "--no-reshard-after-forward"],
    "xla plan": ["--xla-plan"],
    "f32 highest": [],
    "bf16": ["--mixed-precision", "bf16"],
    "bf16 + remat": ["--mixed-precision", "bf16", "--remat"],
    "bf16 + remat + gather at reads": ["--mixed-precision", "bf16", "--remat", "--gather-at-reads"],
    "bf16 + remat + scan": ["--mixed-precision", "bf16", "--remat", "--scan"],
    "bf16 + remat + scan + gather layers": [
        "--mixed-precision",
        "bf16",
        "--remat",
        "--scan",
        "--gather-layers",
    ],
    "bf16 + remat + scan + offload": [
        "--mixed-precision",
        "bf16",
        "--remat",
        "--scan",
        "--offload-optimizer",
    ],
    **{
        f"hybrid tensor={t} + bf16 + remat + scan": [
            "--strategy",
            "hybrid",
            "--tensor",
            str(t),
            "--mixed-precision",
            "bf16",
            "--remat",
            "--scan",
        ]
        for t in (2, 4, 8)
    },
    **{
        f"hybrid across {a} + bf16 + remat + scan": [
            "--strategy",
            "hybrid",
            "--across-slices",
            a,
            "--mixed-precision",
            "bf16",
            "--remat",
            "--scan",
        ]
        for a in ("data", "fsdp")
    },
}

#: options compiled with another default matmul precision. "f32 highest" is the float32
#: reference for the all-gather target: at DEFAULT precision the TPU compiler already
#: gathers the float32 operands of matmuls in bfloat16 (one-pass bf16 dots).
PRECISION: dict[str, str] = {"f32 highest": "highest"}


def measure(size: str, topology: str, option: str, batch: int, seq: int) -> dict[str, Any]:
    """Compile one configuration in this process; the row."""
    from dtensor.analysis.memory import WillNotFitError
    from dtensor.tpu import aot

    module = aot.load_script(DEMO)
    argv = ["--strategy", "fully_sharded", "--model-size", size, "--batch-size", str(batch)]
    argv += ["--seq-len", str(seq), *common.XLA_ATTENTION, *OPTIONS[option]]
    row: dict[str, Any] = {"size": size, "topology": topology, "option": option, "argv": argv}
    row["global_batch"] = batch
    if option in PRECISION:
        import jax

        jax.config.update("jax_default_matmul_precision", PRECISION[option])
        row["matmul_precision"] = PRECISION[option]
    t0 = time.perf_counter()
    try:
        if topology == "cpu":
            import jax

            strategy, step, args = module.aot_step(argv, devices=jax.devices()[:8])
            report = strategy.explain(step, args=tuple(args))
        else:
            name, slices = split_slices(topology)
            report = aot.compile_script(module, argv, topology=name, num_slices=slices).report
    except WillNotFitError as err:
        row.update(
            fits=False,
            required_bytes=err.required,
            compile_seconds=round(time.perf_counter() - t0, 1),
            applied=dict(module.LAST_OPTIONS),
            error=str(err)[:400],
        )
        return row
    fit = report.memory_fit
    kinds = report.by_kind()
    row.update(
        applied=dict(module.LAST_OPTIONS),
        compile_seconds=round(time.perf_counter() - t0, 1),
        peak_bytes_per_chip=fit.bytes_per_chip if fit else report.peak_bytes_per_device,
        xla_peak_bytes_per_device=report.peak_bytes_per_device,
        ideal_peak_bytes_per_device=report.ideal_peak_bytes_per_device,
        ideal_peak_terms=report.to_dict()["ideal_peak_terms"],
        peak_ratio=report.peak_ratio,
        hbm_bytes_per_chip=fit.hbm_bytes_per_chip if fit else None,
        fits=fit.fits if fit else None,
        argument_bytes_per_device=report.argument_bytes_per_device,
        temp_bytes_per_device=report.temp_bytes_per_device,
        state_bytes_per_device=report.state_bytes_per_device,
        comm_bytes_per_device=report.comm_bytes_per_device,
        min_comm_bytes_per_device=report.min_comm_bytes_per_device,
        comm_ratio=report.to_dict()["comm_ratio"],
        all_gather_bytes_per_device=kinds.get("all-gather", 0.0),
        comm_by_kind=kinds,
        ici_bytes_per_device=report.ici_bytes_per_device,
        dcn_bytes_per_device=report.dcn_bytes_per_device,
        dcn_by_kind=_by_kind(c for c in report.collectives if c.network == "dcn"),
        all_gather_dtypes=sorted({c.dtype for c in report.collectives if c.kind == "all-gather"}),
        reduce_bytes_by_dtype=_reduce_bytes_by_dtype(report.collectives),
        min_comm_references=report.min_comm_references,
        step_time_floor_seconds=report.step_time_floor_seconds,
        mfu_ceiling=report.mfu_ceiling,
        step_floor=report.to_dict()["step_floor"],
        mesh=report.mesh,
        libtpu=_libtpu(),
    )
    if topology != "cpu":
        from dtensor.tpu.slices import SliceError, describe_slice

        try:  # the slice as compiled: Cloud TPU's name, grid and links
            row["slice"] = str(describe_slice(split_slices(topology)[0]))
        except SliceError:
            pass
    return row


def _libtpu() -> str | None:
    from importlib import metadata

    for dist in ("libtpu", "libtpu-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _by_kind(collectives: Any) -> dict[str, float]:
    """Bytes per device by collective kind."""
    out: dict[str, float] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0.0) + c.total_bytes_per_device
    return dict(sorted(out.items()))


def _reduce_bytes_by_dtype(collectives: Any) -> dict[str, float]:
    """Bytes per device of gradient reductions (all-reduce, reduce-scatter) by element type."""
    out: dict[str, float] = {}
    for c in collectives:
        if c.kind in ("all-reduce", "reduce-scatter"):
            out[c.dtype] = out.get(c.dtype, 0.0) + c.total_bytes_per_device
    return dict(sorted(out.items()))


#: the cases the targets are judged on come first (the whole run takes a while)
PRIORITY = [
    ("7b", "v5e:4x4", "bf16 + remat"),
    ("2b", "v5e:4x4", "default"),
    ("2b", "v5e:4x4", "bf16"),
    ("2b", "v5e:4x4", "f32 highest"),
    ("2b", "v5e:4x4", "gather at reads"),
    ("2b", "v5e:4x4", "bf16 + remat"),
    ("2b", "v5e:4x4", "bf16 + remat + gather at reads"),
    ("2b", "v5e:4x4", "gather at reads, reshard off"),
    ("2b", "v5p:2x2x2", "default"),
    ("7b", "v5p:2x2x2", "bf16 + remat"),
]

#: options the preset must take itself (no fallback in the model)
NEEDS = {
    "gather at reads, reshard off": "reshard_after_forward",
    "gather at reads": "gather_at_read",
    "xla plan": "gather_at_read",
}


def _skipped(size: str, topology: str, option: str) -> dict[str, Any] | None:
    """The row of an option this version of FullyShardedStrategy does not take (not compiled)."""
    import strategies
    from strategies.step.memory_advice import accepts

    need = NEEDS.get(option)
    if need is None or accepts(strategies.FullyShardedStrategy, need):
        return None
    return {
        "size": size,
        "topology": topology,
        "option": option,
        "applied": {need: "not available"},
    }


def _unavailable(row_options: dict[str, str]) -> bool:
    return any(v == "not available" for v in row_options.values())


def _child(
    size: str, topology: str, option: str, batch: int, seq: int, timeout: int
) -> dict[str, Any]:
    """Run :func:`measure` in a fresh process (8 CPU devices), return its row."""
    cmd = [sys.executable, "-m", "benchmarks.fsdp_scale", "--row", size, topology, option]
    cmd += ["--batch", str(batch), "--seq", str(seq)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {
            "size": size,
            "topology": topology,
            "option": option,
            "error": f"timeout after {timeout} s",
        }
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("ROW "):
            return json.loads(line[4:])
    return {
        "size": size,
        "topology": topology,
        "option": option,
        "error": (done.stderr or done.stdout)[-600:],
        "compile_seconds": round(time.perf_counter() - t0, 1),
    }


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each with the figures it was judged on (``None``: not measured)."""

    def get(size: str, topo: str, option: str) -> dict[str, Any]:
        return next(
            (r for r in rows if (r["size"], r["topology"], r["option"]) == (size, topo, option)), {}
        )

    out = []
    d, g = get("2b", "v5e:4x4", "default"), get("2b", "v5e:4x4", "gather at reads")
    for name, other in (
        ("XLA's own plan", get("2b", "v5e:4x4", "xla plan")),
        ("gather at reads", g),
    ):
        if d.get("peak_bytes_per_chip") and other.get("peak_bytes_per_chip"):
            out.append(
                {
                    "target": f"v5e:4x4 2b default peak <= {name}",
                    "value": d["peak_bytes_per_chip"] / other["peak_bytes_per_chip"],
                    "met": d["peak_bytes_per_chip"] <= other["peak_bytes_per_chip"],
                }
            )
    if d.get("peak_bytes_per_chip") and d.get("ideal_peak_bytes_per_device"):
        ratio = d["peak_bytes_per_chip"] / d["ideal_peak_bytes_per_device"]
        out.append(
            {"target": "v5e:4x4 2b default peak <= 1.3x ideal", "value": ratio, "met": ratio <= 1.3}
        )
    b = get("2b", "v5e:4x4", "bf16")
    for name, ref in (("float32 (HIGHEST)", get("2b", "v5e:4x4", "f32 highest")), ("default", d)):
        if ref.get("all_gather_bytes_per_device") and b.get("all_gather_bytes_per_device"):
            ratio = b["all_gather_bytes_per_device"] / ref["all_gather_bytes_per_device"]
            out.append(
                {
                    "target": f"v5e:4x4 2b bf16 all-gathers <= 0.55x {name}",
                    "value": ratio,
                    "met": ratio <= 0.55,
                }
            )
    for option in ("bf16 + remat", "bf16 + remat + gather at reads"):
        s = get("7b", "v5e:4x4", option)
        if not s:
            continue
        out.append(
            {
                "target": f"v5e:4x4 7b batch 16x1024 fits with {option}",
                "value": s.get("peak_bytes_per_chip") or s.get("required_bytes"),
                "met": bool(s.get("fits")),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2b,7b")
    p.add_argument("--topologies", default="v5e:4x4,v5p:2x2x2")
    p.add_argument(
        "--options",
        default=None,
        help="options to measure, separated by ',' (or ';' where a name has a comma); default all",
    )
    p.add_argument(
        "--cpu-sizes", default="tiny", help="sizes also compiled for 8 CPU devices ('' for none)"
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per compile")
    p.add_argument("--jobs", type=int, default=1, help="compiles at once (each in its own process)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of the existing results file that this run does not measure",
    )
    p.add_argument("--row", nargs=3, metavar=("SIZE", "TOPOLOGY", "OPTION"), help=argparse.SUPPRESS)
    p.add_argument(
        "--maxtext",
        action="store_true",
        help="measure the rows of the side-by-side table with MaxText (MAXTEXT_ROWS) instead "
        "of --sizes x --topologies x --options",
    )
    p.add_argument(
        "--markdown",
        metavar="TOPOLOGY",
        help="print the results file's rows for TOPOLOGY as a Markdown table (compiles nothing; "
        "GPU topologies read fsdp_scale_gpu.json; 'maxtext': the side by side with MaxText; "
        "'slices': the rows on several slices, with what crosses DCN; 'compact': the README's "
        "one row a model against MaxText)",
    )
    args = p.parse_args(argv)
    if args.markdown:
        side = (args.out or common.RESULTS) / "maxtext_side.json"  # MaxText's floors
        theirs = json.loads(side.read_text()) if side.exists() else None
        mine = {
            "maxtext": lambda p: side_by_side(p, theirs),
            "slices": slices_table,
            "compact": lambda p: compact(p, theirs or {"rows": []}),
        }
        name = "fsdp_scale" if args.markdown in mine else results_name([args.markdown])
        payload = json.loads(((args.out or common.RESULTS) / f"{name}.json").read_text())
        printer = mine.get(args.markdown)
        print(printer(payload) if printer else markdown(payload, args.markdown))
        return
    if args.row:
        common.ensure_devices()
        size, topology, option = args.row
        batch = BATCH.get(size, args.batch) if topology != "cpu" else args.batch
        print("ROW " + json.dumps(measure(size, topology, option, batch, args.seq), sort_keys=True))
        return
    sep = ";" if args.options is not None and ";" in args.options else ","
    given = args.options.split(sep) if args.options is not None else list(OPTIONS)
    options = [o.strip() for o in given if o.strip()]
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        p.error(f"--options: {unknown} are not options; valid: {', '.join(OPTIONS)}")
    pairs = [(s, t) for s in args.sizes.split(",") if s for t in args.topologies.split(",") if t]
    pairs += [(s, "cpu") for s in args.cpu_sizes.split(",") if s]
    plan = [(s, t, o) for s, t in pairs for o in options]
    if args.maxtext:
        plan = [MAXTEXT_ROWS[i] for i in MAXTEXT_ORDER]
    try:
        name = results_name(sorted({t for _, t, _ in plan}))
    except ValueError as err:
        p.error(str(err))
    # The judged cases first, then the quick CPU rows, then the rest.
    if not args.maxtext:
        plan.sort(
            key=lambda c: PRIORITY.index(c) if c in PRIORITY else len(PRIORITY) + (c[1] != "cpu")
        )
    rows: list[dict[str, Any]] = []
    given_argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", "benchmarks.fsdp_scale", *given_argv])
    payload: dict[str, Any] = {"global_batch": args.batch, "seq_len": args.seq, "rows": rows}
    payload["commands"] = [command]
    done: dict[tuple[str, str, str], dict[str, Any]] = {}
    lock = threading.Lock()
    if args.merge:
        path = (args.out or common.RESULTS) / f"{name}.json"
        if path.exists():
            before = json.loads(path.read_text())
            payload["commands"] = [*before.get("commands", []), command]
            for row in before.get("rows", []):
                case = (row["size"], row["topology"], row["option"])
                if case not in plan:
                    plan.append(case)
                    done[case] = row

    def one(case: tuple[str, str, str]) -> None:
        size, topology, option = case
        seq = args.seq if topology != "cpu" else 64
        batch = BATCH.get(size, args.batch) if topology != "cpu" else args.batch
        row = _skipped(size, topology, option) or _child(
            size, topology, option, batch, seq, args.timeout
        )
        if _unavailable(row.get("applied", {})):
            row["note"] = "an option is not available in this version of FullyShardedStrategy"
        with lock:
            done[case] = row
            rows[:] = [done[c] for c in plan if c in done]
            payload["targets"] = targets(rows)
            common.write_json(name, payload, args.out)
            print(f"{size} {topology} {option}: {_brief(row)}", flush=True)

    common.ensure_devices()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, [c for c in plan if c not in done]))
    path = common.write_json(name, payload, args.out)
    _print(payload)
    print(f"wrote {path}")


def _brief(row: dict[str, Any]) -> str:
    h = common_human
    if "error" in row and row.get("fits") is not False:
        return "error: " + row["error"].splitlines()[-1][:200] if row["error"] else "error"
    return (
        f"peak {h(row.get('peak_bytes_per_chip') or row.get('required_bytes'))}, "
        f"ideal {h(row.get('ideal_peak_bytes_per_device'))}, fits {row.get('fits')}, "
        f"{row.get('compile_seconds')} s, applied {row.get('applied')}"
    )


def _print(payload: dict[str, Any]) -> None:
    h = common_human
    table = []
    for r in payload["rows"]:
        applied = r.get("applied") or {}
        how = (
            ", ".join(
                f"{k} by {v.split(' ')[0]}" if v != "not available" else f"{k} n/a"
                for k, v in applied.items()
            )
            or "-"
        )
        table.append(
            (
                f"{r['size']} {r['topology']}",
                r["option"],
                h(r.get("peak_bytes_per_chip") or r.get("required_bytes")),
                h(r.get("ideal_peak_bytes_per_device")),
                "-" if r.get("fits") is None else ("yes" if r["fits"] else "NO"),
                "-" if r.get("comm_ratio") is None else f"{r['comm_ratio']:.2f}",
                h(r.get("all_gather_bytes_per_device")),
                "-" if r.get("compile_seconds") is None else f"{r['compile_seconds']:.0f}",
                how if "error" not in r or r.get("fits") is False else "error",
            )
        )
    common.print_table(
        f"FullyShardedStrategy, decoder, global batch {payload['global_batch']} x {payload['seq_len']}, per chip",
        [
            "model / topology",
            "option",
            "peak",
            "ideal peak",
            "fits",
            "comm/min",
            "all-gather",
            "compile s",
            "applied",
        ],
        table,
    )
    common.print_table(
        "targets",
        ["target", "value", "met"],
        [
            (
                t["target"],
                t["value"] if isinstance(t["value"], float) else h(t["value"]),
                "yes" if t["met"] else "NO",
            )
            for t in payload.get("targets", [])
        ],
    )


def common_human(n: float | None) -> str:
    from dtensor.core.text import human_bytes

    return "-" if n is None else human_bytes(n)


if __name__ == "__main__":
    main()
