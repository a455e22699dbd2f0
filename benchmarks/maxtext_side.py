"""MaxText's own training step compiled for the side-by-side topologies, read by our floor code.

    python -m benchmarks.maxtext_side [--rows 0,1] [--venv /work/.venv-maxtext] [--cache DIR]
    python -m benchmarks.maxtext_side --report      # the table from the results file only

For each row of :data:`ROWS` (the side-by-side table's MaxText configurations,
:data:`benchmarks.fsdp_tables.MAXTEXT_GIB`, and optionally Llama 3.1 405B), a
small driver (written into the cache folder, run by the MaxText venv's Python:
``maxtext==0.2.5``, ``jax[tpu]==0.12.0.1``, Python 3.12) runs MaxText's
``train_compile`` with its defaults and the row's overrides, compiling the train
step ahead of time for ``jax.experimental.topologies`` (no TPU). It replaces
``train_compile.jit_and_compile`` by one that also traces the step, so it can
write, beside the compiled program's HLO text (``compiled.as_text()``) and
``memory_analysis()``: the step's matmul FLOPs, counted on its jaxpr by
:func:`dtensor.analysis.floor.matmul_flops` (the count ``explain`` uses), the
mesh (axes, each device's slice) and the chip. The libtpu of each row is pinned
(``TPU_LIBRARY_PATH`` to a ``pip install --target`` folder) and recorded.

Then, in our venv, :func:`analyse` reads the HLO with
:func:`dtensor.analysis.hlo.parse_collectives` and takes the floor with
:func:`dtensor.analysis.floor.step_floor`, as ``explain`` does for our programs:
the ICI term is the collectives within slices, the DCN term those between. The
MFU ceiling divides the model FLOPs of our row (the same model, batch and
sequence, :func:`examples.decoder.model_flops`) by ``devices x peak x floor``,
so it compares with our column as the floors do; MaxText's own count
(``calculate_tflops_training_per_device``) is kept beside it. Writes
``benchmarks/results/maxtext_side.json`` after every row and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import common

GIB = float(1 << 30)
REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("MAXTEXT_VENV", "/work/.venv-maxtext"))
CACHE = Path(os.environ.get("MAXTEXT_SIDE_CACHE", Path.home() / ".cache" / "dtensor" / "maxtext"))
#: A libtpu other than the venv's: ``pip install --no-deps --target DIR libtpu==V``.
LIBTPU_DIRS = {"0.0.52": Path(os.environ.get("LIBTPU_0052", "/work/.libtpu-0.0.52"))}

#: The matmul count the driver records (2: shard_map bodies per device, Pallas kernels per
#: grid step); a cached compile with another is traced again for its FLOPs.
FLOPS_VERSION = 2

Row = tuple[str, str, tuple[str, ...], str | None]


def _row(
    size: str,
    topology: str,
    model: str,
    target: str,
    slices: int = 1,
    libtpu: str | None = "0.0.52",
    extra: tuple[str, ...] = (),
    seq: int = 1024,
) -> Row:
    overrides = (f"model_name={model}", f"compile_topology={target}", "per_device_batch_size=1")
    return (
        size,
        topology,
        (*overrides, f"max_target_length={seq}", f"compile_topology_num_slices={slices}", *extra),
        libtpu,
    )


#: ``(size, topology as the side-by-side table writes it, MaxText overrides, libtpu)``;
#: a libtpu of ``None`` is the venv's own (0.0.50.1 beside jax 0.12.0.1).
ROWS: list[Row] = [
    _row("2b", "v5e:4x4", "gemma-2b", "v5e-16"),
    _row("7b", "v5e:4x4", "gemma-7b", "v5e-16"),
    _row("gemma3-12b", "v5e:4x4", "gemma3-12b", "v5e-16"),
    _row("llama2-70b", "v5p:4x4x4", "llama2-70b", "v5p-128"),
    _row("llama2-70b", "2 x v5p:4x4x2", "llama2-70b", "v5p-64", slices=2, libtpu=None),
    _row("llama3.1-405b", "v5p:8x8x8", "llama3.1-405b", "v5p-1024"),
    # Mixtral 8x7B, expert 8 x fsdp 4 (benchmarks.experts' row; dropless, megablox).
    _row(
        "mixtral-8x7b",
        "v5p:4x4x2",
        "mixtral-8x7b",
        "v5p-64",
        libtpu=None,
        extra=("ici_expert_parallelism=8",),
    ),
    # the pipeline row: the two slices as two stages, 2 microbatches (its own topology label,
    # as rows are keyed, cached and merged by size and topology: row 4's would collide)
    _row(
        "llama2-70b",
        "2 x v5p:4x4x2 pipeline",
        "llama2-70b",
        "v5p-64",
        slices=2,
        libtpu=None,
        extra=(
            "dcn_pipeline_parallelism=2",
            "dcn_data_parallelism=1",
            "num_pipeline_microbatches=2",
        ),
    ),
    # Llama 3.1 8B at 32768 tokens, context 8 x fsdp 4 (its own topology label: row 6's
    # would collide); per_device_batch_size=1, so 32 sequences over the 32 chips
    _row(
        "llama3.1-8b",
        "v5p:4x4x2 context 32768",
        "llama3.1-8b",
        "v5p-64",
        libtpu=None,
        extra=("ici_context_parallelism=8", "ici_fsdp_parallelism=4"),
        seq=32768,
    ),
]

#: The driver the MaxText venv runs: ``driver.py REPO OUT_DIR override...``.
DRIVER = '''\
"""Written by benchmarks/maxtext_side.py: MaxText's train_compile, keeping what it compiles."""
import importlib.metadata, json, os, sys, time
repo, out, *overrides = sys.argv[1:]
sys.path.insert(0, repo)
import jax
from absl import app
from maxtext.trainers.pre_train import train_compile as tc
from maxtext.utils import max_utils, maxtext_utils
from dtensor.analysis.floor import matmul_flops
FLOPS_VERSION = int(os.environ["MAXTEXT_SIDE_FLOPS_VERSION"])


def libtpu_version():
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path:
        for info in os.listdir(os.path.dirname(os.path.dirname(path))):
            if info.startswith("libtpu-") and info.endswith(".dist-info"):
                return info[len("libtpu-") : -len(".dist-info")]
    return importlib.metadata.version("libtpu")


def jit_and_compile(func, args, kwargs, mesh, in_shardings, out_shardings, static_argnums,
                    donate_argnums, config, logical_axis_rules):
    with jax.set_mesh(mesh), logical_axis_rules:
        jitted = jax.jit(func, in_shardings=in_shardings, out_shardings=out_shardings,
                         static_argnums=static_argnums, donate_argnums=donate_argnums)
        t0 = time.perf_counter()
        traced = jitted.trace(*args, **kwargs)
        lowered = traced.lower()
    flops = matmul_flops(traced.jaxpr)
    t1 = time.perf_counter()
    if os.environ.get("MAXTEXT_SIDE_TRACE_ONLY"):  # a cached compile, its FLOPs counted anew
        path = os.path.join(out, "compiled.json")
        record = json.load(open(path))
        record.update(matmul_flops=flops, matmul_flops_version=FLOPS_VERSION)
        json.dump(record, open(path, "w"), indent=2)
        print("maxtext_side: recounted", out, flush=True)
        os._exit(0)
    options = max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags)
    compiled = lowered.compile(compiler_options=options)
    t2 = time.perf_counter()
    open(os.path.join(out, "hlo.txt"), "w").write(compiled.as_text())
    mem = compiled.memory_analysis()
    fields = ("argument", "output", "alias", "temp", "generated_code")
    total, weights, attention = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
    devices = list(mesh.devices.flat)
    record = {
        "overrides": overrides,
        "libtpu": libtpu_version(),
        "jax": jax.__version__,
        "maxtext": importlib.metadata.version("maxtext"),
        "memory": {f"{f}_size_in_bytes": int(getattr(mem, f"{f}_size_in_bytes")) for f in fields},
        "matmul_flops": flops,
        "matmul_flops_version": FLOPS_VERSION,
        "maxtext_tflops_per_device": total,
        "mesh_shape": [[str(a), int(s)] for a, s in mesh.shape.items()],
        "slices": [int(getattr(d, "slice_index", 0)) for d in devices],
        "device_kind": devices[0].device_kind,
        "trace_seconds": t1 - t0,
        "compile_seconds": t2 - t1,
    }
    json.dump(record, open(os.path.join(out, "compiled.json"), "w"), indent=2)
    print("maxtext_side: wrote", out, flush=True)
    return compiled


tc.jit_and_compile = jit_and_compile
app.run(tc.main, argv=["train_compile", *overrides])
'''


def row_key(size: str, topology: str) -> str:
    """The cache folder (and results key) of a row: ``"llama2-70b@2 x v5p:4x4x2"`` as
    ``llama2-70b_2xv5p-4x4x2``.

    Examples:
        >>> row_key("llama2-70b", "2 x v5p:4x4x2"), row_key("2b", "v5e:4x4")
        ('llama2-70b_2xv5p-4x4x2', '2b_v5e-4x4')
    """
    return f"{size}_{topology.replace(' ', '').replace(':', '-')}"


def peak_bytes(memory: dict[str, int]) -> int:
    """MaxText's peak per chip as the side-by-side table counts it: arguments + outputs -
    aliased + temporaries + generated code (``compiled.memory_analysis()`` fields).

    Examples:
        >>> peak_bytes({"argument_size_in_bytes": 10, "output_size_in_bytes": 10,
        ...             "alias_size_in_bytes": 9, "temp_size_in_bytes": 5,
        ...             "generated_code_size_in_bytes": 1})
        17
    """
    m = memory
    return (
        m["argument_size_in_bytes"]
        + m["output_size_in_bytes"]
        - m["alias_size_in_bytes"]
        + m["temp_size_in_bytes"]
        + m["generated_code_size_in_bytes"]
    )


def analyse(hlo_text: str, record: dict[str, Any], model_flops: float | None) -> dict[str, Any]:
    """The floor of a compiled program from its HLO text and the driver's ``record``
    (``mesh_shape``, ``slices``, ``device_kind``, ``matmul_flops``, ``memory``), the way
    :func:`dtensor.explain` takes ours: collectives by
    :func:`~dtensor.analysis.hlo.parse_collectives`, split by network, and
    :func:`~dtensor.analysis.floor.step_floor` on the chip of the hardware table.
    ``model_flops`` (one step's) gives the MFU ceiling.
    """
    from dtensor.analysis.floor import step_floor
    from dtensor.analysis.hardware import CHIPS
    from dtensor.analysis.hlo import parse_collectives

    mesh_shape = [(str(a), int(s)) for a, s in record["mesh_shape"]]
    collectives = parse_collectives(hlo_text, mesh_shape, slices=record["slices"])
    by_network: dict[str, float] = {"ici": 0.0, "dcn": 0.0}
    by_kind: dict[str, float] = {}
    for c in collectives:
        by_network[c.network] = by_network.get(c.network, 0.0) + c.total_bytes_per_device
        key = f"{c.network} {c.kind}"
        by_kind[key] = by_kind.get(key, 0.0) + c.total_bytes_per_device
    repeats = async_repeats(hlo_text)
    repeated = sum(c.total_bytes_per_device for c in collectives if c.name in repeats)
    devices = len(record["slices"])
    chip = CHIPS[record["device_kind"]]
    floor = step_floor(
        record["matmul_flops"] / devices,
        by_network["ici"],
        by_network["dcn"],
        chip,
        devices=devices,
    )
    return {
        "peak_bytes_per_chip": peak_bytes(record["memory"]),
        "memory": record["memory"],
        "devices": devices,
        "mesh": {a: s for a, s in mesh_shape if s > 1},
        "step_floor": floor.to_dict(),
        "step_time_floor_seconds": floor.seconds,
        "model_flops": model_flops,
        "mfu_ceiling": floor.mfu_ceiling(model_flops) if model_flops else None,
        "ici_bytes_per_device": by_network["ici"],
        "dcn_bytes_per_device": by_network["dcn"],
        "comm_by_kind": dict(sorted(by_kind.items())),
        # libtpu's async collective fusions repeat a collective (same channel) in the fusion
        # that starts it, each continuation and the one that ends it; the floor counts every
        # copy, as explain does. These are the bytes of the copies after the first.
        "async_repeat_bytes_per_device": repeated,
        "ici_seconds_without_repeats": (by_network["ici"] - repeated) / chip.ici_bytes_per_s,
        # libtpu's collective matmuls (windowed einsums: a loop of collective-permutes
        # beside the matmul's blocks), as while loops in the HLO
        "collective_matmul_loops": len(
            re.findall(r"body=%?(?:wide\.)?windowed_dot_general_body", hlo_text)
        ),
        "collectives": len(collectives),
    }


def async_repeats(hlo_text: str) -> set[str]:
    """Names of the collectives that repeat one started earlier in an async collective
    fusion chain: those in ``async_collective_fusion*`` computations (continuations) and
    in fusions ending with an ``AsyncCollectiveDone`` custom call.

    Examples:
        >>> text = (
        ...     "%start (p: f32[4]) -> f32[8] {\\n"
        ...     "  %ag.1 = f32[8]{0} all-gather(%p), channel_id=3, dimensions={0}\\n"
        ...     '  ROOT %s = f32[8]{0} custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"\\n'
        ...     "}\\n"
        ...     "%async_collective_fusion.2 (p: f32[4]) -> f32[8] {\\n"
        ...     "  ROOT %ag.2 = f32[8]{0} all-gather(%p), channel_id=3, dimensions={0}\\n"
        ...     "}\\n")
        >>> sorted(async_repeats(text))
        ['ag.2']
    """
    from dtensor.analysis.hlo import KINDS
    from dtensor.analysis.hlo_text import computations

    comps, _ = computations(hlo_text)
    out: set[str] = set()
    for name, instrs in comps.items():
        done = any(i.opcode == "custom-call" and '"AsyncCollectiveDone"' in i.rest for i in instrs)
        if name.startswith("async_collective_fusion") or done:
            out.update(i.name for i in instrs if i.opcode in KINDS)
    return out


def seq_of(overrides: tuple[str, ...] | list[str]) -> int:
    """A row's sequence length: its ``max_target_length`` override (1024 without one).

    Examples:
        >>> seq_of(ROWS[0][2]), seq_of(("max_target_length=32768",)), seq_of(())
        (1024, 32768, 1024)
    """
    lengths = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("max_target_length=")]
    return lengths[-1] if lengths else 1024


def model_flops_of(size: str, topology: str, devices: int, seq: int = 1024) -> float | None:
    """One step's model FLOPs of our decoder at the row's shapes (MaxText's
    ``per_device_batch_size=1``: one sequence of ``seq`` per chip), the count our rows'
    MFU ceilings use; ``None`` for a size our decoder lacks."""
    from examples.decoder import CONFIGS, model_flops

    cfg = CONFIGS.get(size)
    return None if cfg is None else model_flops(cfg, devices, seq)


def compile_row(row: Row, *, venv: Path, cache: Path, timeout: float) -> dict[str, Any]:
    """Run the driver for one row in the MaxText venv (unless its cache holds the compile);
    ``{"error": ...}`` when it fails or runs past ``timeout`` seconds."""
    size, topology, overrides, libtpu = row
    out = cache / row_key(size, topology)
    out.mkdir(parents=True, exist_ok=True)
    driver = cache / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env["MAXTEXT_SIDE_FLOPS_VERSION"] = str(FLOPS_VERSION)
    cached = (out / "compiled.json").exists() and (out / "hlo.txt").exists()
    if cached:
        record = json.loads((out / "compiled.json").read_text())
        if record.get("matmul_flops_version") == FLOPS_VERSION:
            return {"cached": True}
        env["MAXTEXT_SIDE_TRACE_ONLY"] = "1"  # trace again (seconds), keep the compile
    env.pop("TPU_LIBRARY_PATH", None)
    if libtpu is not None:
        env["TPU_LIBRARY_PATH"] = str(LIBTPU_DIRS[libtpu] / "libtpu" / "libtpu.so")
    cmd = [str(venv / "bin" / "python"), str(driver), str(REPO), str(out), *overrides]
    start = time.perf_counter()
    log_path = out / ("trace.txt" if cached else "log.txt")
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return {"error": f"compile ran past {timeout:.0f} s", "wall_seconds": timeout}
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not (out / "compiled.json").exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)[-400:]}", "wall_seconds": wall}
    return {"cached": cached, "wall_seconds": wall}


def result_row(row: Row, out: Path) -> dict[str, Any]:
    """A results row from a row's cache folder (the driver's files): what it compiled, with
    :func:`analyse`'s figures."""
    size, topology, overrides, _ = row
    record = json.loads((out / "compiled.json").read_text())
    devices = len(record["slices"])
    ours = model_flops_of(size, topology, devices, seq_of(overrides))
    theirs = record["maxtext_tflops_per_device"] * 1e12 * devices
    figures = analyse((out / "hlo.txt").read_text(), record, ours or theirs)
    return {
        "size": size,
        "topology": topology,
        "overrides": list(overrides),
        "libtpu": record["libtpu"],
        "jax": record["jax"],
        "maxtext": record["maxtext"],
        "compile_seconds": round(record["compile_seconds"], 1),
        "trace_seconds": round(record["trace_seconds"], 1),
        "model_flops_source": "ours (examples.decoder.model_flops)" if ours else "MaxText's",
        "maxtext_model_flops": theirs,
        **figures,
    }


def load(path: Path) -> dict[str, Any]:
    """The results file's payload (``{"rows": []}`` when absent)."""
    return json.loads(path.read_text()) if path.exists() else {"rows": []}


def merge(payload: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with ``row`` in place of the row of the same size and topology.

    Examples:
        >>> p = merge({"rows": [{"size": "2b", "topology": "v5e:4x4", "x": 1}]},
        ...           {"size": "2b", "topology": "v5e:4x4", "x": 2})
        >>> p["rows"]
        [{'size': '2b', 'topology': 'v5e:4x4', 'x': 2}]
    """
    rows = [
        r
        for r in payload.get("rows", [])
        if (r["size"], r["topology"]) != (row["size"], row["topology"])
    ]
    order = {(s, t): i for i, (s, t, _, _) in enumerate(ROWS)}
    rows.append(row)
    rows.sort(key=lambda r: order.get((r["size"], r["topology"]), len(order)))
    return {k: v for k, v in payload.items() if k not in ("benchmark", "environment")} | {
        "rows": rows
    }


def by_row(payload: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """The measured rows (with a floor) by ``(size, topology)``, as the side-by-side table
    looks them up."""
    return {
        (r["size"], r["topology"]): r
        for r in payload.get("rows", [])
        if r.get("step_time_floor_seconds")
    }


def ours_best(fsdp_scale: dict[str, Any]) -> dict[tuple[str, str], float]:
    """Our lowest step-time floor per ``(size, topology)`` in ``fsdp_scale.json``'s rows.

    Examples:
        >>> rows = [{"size": "2b", "topology": "v5e:4x4", "step_time_floor_seconds": s}
        ...         for s in (0.2, 0.1, None)]
        >>> ours_best({"rows": rows})
        {('2b', 'v5e:4x4'): 0.1}
    """
    best: dict[tuple[str, str], float] = {}
    for r in fsdp_scale.get("rows", []):
        floor, key = r.get("step_time_floor_seconds"), (r["size"], r["topology"])
        if floor and (key not in best or floor < best[key]):
            best[key] = floor
    return best


def table_rows(payload: dict[str, Any], ours: dict[tuple[str, str], float]) -> list[list[str]]:
    """The printed table: one line a row (``ours``: our lowest floor for it), a failed row
    with its error."""
    out = []
    for r in payload.get("rows", []):
        if not r.get("step_time_floor_seconds"):
            out.append([r["size"], r["topology"], r.get("libtpu") or "—"] + ["—"] * 6)
            out[-1].append(r.get("error", "")[:60])
            continue
        f = r["step_floor"]
        terms = f"{f['compute_seconds'] * 1e3:.0f} / {f['ici_seconds'] * 1e3:.0f} / " + (
            f"{f['dcn_seconds'] * 1e3:.0f}" if f.get("dcn_seconds") else "0"
        )
        mine = ours.get((r["size"], r["topology"]))
        out.append(
            [
                r["size"],
                r["topology"],
                r["libtpu"],
                f"{r['peak_bytes_per_chip'] / GIB:.2f} GiB",
                f"{r['step_time_floor_seconds'] * 1e3:.0f} ms",
                f"{r['mfu_ceiling']:.0%}",
                terms,
                f["bound"],
                "—" if mine is None else f"{mine * 1e3:.0f} ms",
                f"{r['compile_seconds']:.0f} s",
            ]
        )
    return out


def print_results(payload: dict[str, Any], out_dir: Path) -> None:
    """The rich table, with our lowest floor per row from ``fsdp_scale.json`` beside it."""
    path = out_dir / "fsdp_scale.json"
    ours = ours_best(load(path if path.exists() else common.RESULTS / "fsdp_scale.json"))
    common.print_table(
        "MaxText 0.2.5's own train step, read by our floor code",
        [
            "model",
            "topology",
            "libtpu",
            "peak per chip",
            "floor",
            "MFU ceiling",
            "compute / ICI / DCN ms",
            "bound",
            "ours (lowest)",
            "compile",
        ],
        table_rows(payload, ours),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument(
        "--rows",
        default="0,1,2,3,4",
        help="indices into ROWS (default: the side-by-side table's; 5 is 405B, 6 Mixtral 8x7B, "
        "7 llama2-70b pipelined, 8 llama3.1-8b context-parallel at 32768)",
    )
    parser.add_argument("--venv", type=Path, default=VENV)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per compile")
    parser.add_argument("--report", action="store_true", help="print the results file only")
    args = parser.parse_args(argv)
    path = args.out / "maxtext_side.json"
    payload = load(path)
    if not args.report:
        for i in (int(x) for x in args.rows.split(",") if x.strip()):
            row = ROWS[i]
            out = args.cache / row_key(row[0], row[1])
            print(f"maxtext_side: {row[0]} on {row[1]} ...", flush=True)
            status = compile_row(row, venv=args.venv, cache=args.cache, timeout=args.timeout)
            if "error" in status:
                figures = {
                    "size": row[0],
                    "topology": row[1],
                    "overrides": list(row[2]),
                    "libtpu": row[3],
                    **status,
                }
            else:
                figures = result_row(row, out)
            payload = merge(payload, figures)
            common.write_json("maxtext_side", payload, args.out)
    print_results(payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
