"""``python -m dtensor.aot``: compile a training script's step for a TPU or GPU topology, here.

    python -m dtensor.aot --topology v5e:4x4 --strategy fully_sharded -- examples/train.py
    python -m dtensor.aot --topology v5e:4x4 --num-slices 2 --strategy mirrored \\
        -- examples/train.py --model-size medium --batch-size 64
    python -m dtensor.aot --topology h100:2x8 --strategy fully_sharded -- examples/train.py

The script is imported as a module (its ``if __name__ == "__main__":`` block
does not run) and must define the hook

    aot_step(argv: list[str], *, devices) -> (strategy, step, args)

which parses the script's own arguments, builds its strategy over
``devices`` (the topology's devices, from :func:`dtensor.tpu_topology`) and
returns it with the train step and the step's arguments, abstract
(``jax.ShapeDtypeStruct`` batches, ``nnx.eval_shape`` models: nothing is
allocated). The CLI compiles ``strategy.explain(step, args=args)`` with the
real TPU compiler and prints, per chip: memory against the chip's HBM with a
verdict, and communication split into ICI (within a slice) and DCN (between
slices). A GPU topology (``h100:2x8``: hosts x GPUs per host, see
:func:`dtensor.gpu_topology`) is compiled by XLA's GPU compiler instead, and
its communication split into NVLink (within a host) and InfiniBand/RoCE
(between hosts). ``--strategy NAME`` is passed on to the script, as are options the
CLI does not know.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from dtensor.core.text import human_bytes
from dtensor.tpu.scripts import HOOK, AotError, load_script, topology_devices

__all__ = ["AotError", "AotResult", "cli", "compile_script", "load_script", "main", "summary"]


class AotResult:
    """What :func:`compile_script` compiled: the report and where."""

    def __init__(
        self,
        report: Any,
        strategy: Any,
        topology: str,
        num_slices: int,
        devices: list[Any],
        seconds: float,
    ):
        self.report = report
        self.strategy = strategy
        self.topology = topology
        self.num_slices = num_slices
        self.devices = devices
        self.seconds = seconds

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the topology, the strategy's mesh, and the report."""
        return {
            "compile_seconds": self.seconds,
            "device_kind": self.devices[0].device_kind,
            "devices": len(self.devices),
            "num_slices": self.num_slices,
            "report": self.report.to_dict(),
            "strategy": getattr(self.strategy, "name", type(self.strategy).__name__),
            "topology": self.topology,
            **({"slice": self.slice_text} if self.slice_text else {}),
        }

    @property
    def slice_text(self) -> str | None:
        """A TPU slice as Cloud TPU names it: ``v5p-128 (v5p:4x4x4, 64 chips, torus xyz)``."""
        if self.devices[0].platform != "tpu":
            return None
        from dtensor.tpu.slices import SliceError, describe_slice

        try:
            return str(describe_slice(self.topology))
        except SliceError:
            return None


def compile_script(
    script: str | os.PathLike[str] | ModuleType,
    argv: Sequence[str] = (),
    *,
    topology: str,
    num_slices: int = 1,
) -> AotResult:
    """Compile a script's train step for a TPU or GPU topology; nothing runs.

    Args:
        script: the script's path (or the module, from :func:`load_script`).
        argv: the script's own arguments (``--strategy fully_sharded``...).
        topology: a TPU topology name (``"v5e:4x4"``, see
            :func:`dtensor.tpu_topology`) or a GPU one (``"h100:2x8"``, see
            :func:`dtensor.gpu_topology`).
        num_slices: slices of that topology, joined by DCN (TPU) or the
            network between hosts (GPU).

    Returns:
        An :class:`AotResult`; ``.report`` is the :class:`dtensor.Report`.

    Raises:
        AotError: the script or its hook's result is unusable.
        dtensor.tpu.topology.TopologyError: an unknown topology.
    """
    module = script if isinstance(script, ModuleType) else load_script(script)
    devices = topology_devices(topology, num_slices=num_slices)
    got = getattr(module, HOOK)(list(argv), devices=devices)
    if not (isinstance(got, tuple) and len(got) == 3 and hasattr(got[0], "explain")):
        raise AotError(
            f"{HOOK}() returned {type(got).__name__} {str(got)[:80]!r}; it must return the "
            "tuple (strategy, step, args), strategy being a strategies preset built over devices."
        )
    strategy, step, args = got
    t0 = time.perf_counter()
    report = strategy.explain(step, args=tuple(args))
    seconds = time.perf_counter() - t0
    flops_hook = getattr(module, "model_flops", None)
    flops = flops_hook(list(argv)) if callable(flops_hook) else None
    if flops:
        report = report.with_model_flops(flops)
    return AotResult(report, strategy, topology, num_slices, devices, seconds)


def _human(n: float | None) -> str:
    return "-" if n is None else human_bytes(n)


def summary(result: AotResult, *, title: str = "") -> str:
    """The per-chip view of an :class:`AotResult`: memory vs HBM, traffic by network and kind."""
    from rich.console import Console
    from rich.table import Table

    from dtensor.analysis.report import memory_rows, network_rows

    r = result.report
    console = Console(file=io.StringIO(), width=110, color_system=None, force_terminal=False)
    d0 = result.devices[0]
    gpu = d0.platform == "gpu"
    unit, compiler = ("GPU", "XLA:GPU") if gpu else ("chip", "the TPU compiler")
    if r.memory_fit is not None and r.memory_fit.unit == "TensorCore":  # tpu7x: 2 devices a chip
        unit = "TensorCore"
    if gpu:
        hosts = len({d.process_index for d in result.devices})
        slices = f" ({hosts} hosts of {len(result.devices) // hosts})"
        slices += f", {result.num_slices} slices" if result.num_slices > 1 else ""
    else:
        slices = f", {result.num_slices} slices over DCN" if result.num_slices > 1 else ""
    head = title or "dtensor.aot"
    name = result.slice_text or result.topology
    console.print(
        f"{head}: {name}{slices} = {len(result.devices)} {d0.device_kind} devices; "
        f"{r.mesh}; compiled by {compiler} in {result.seconds:.1f} s",
        highlight=False,
        soft_wrap=True,
    )
    fit = r.memory_fit
    mem = Table(title=f"memory per {unit}", show_header=False)
    mem.add_column("figure")
    mem.add_column("bytes", justify="right")
    for k, v in memory_rows(r):
        mem.add_row(k, _human(v) if v is not None else "")
    console.print(mem)

    comm = Table(title=f"communication per {unit}, one step")
    for name in ("network", "kind", "mesh axes", "ops", "bytes"):
        comm.add_column(name, justify="right" if name in ("ops", "bytes") else "left")
    groups: dict[tuple[str, str, tuple[str, ...]], list[float]] = {}
    for c in r.collectives:
        key = (c.network or "-", c.kind, tuple(c.mesh_axes))
        acc = groups.setdefault(key, [0, 0.0])
        acc[0] += c.count
        acc[1] += c.total_bytes_per_device
    for (net, kind, axes), (ops, nbytes) in sorted(groups.items()):
        label = {"nvlink": "NVLink", "ib": "IB/RoCE"}.get(net, net.upper())
        comm.add_row(label, kind, ",".join(axes) or "-", str(int(ops)), _human(nbytes))
    if not groups:
        comm.add_row("-", "none", "-", "0", "0 B")
    split = ", ".join(f"{name.split(' (')[0]} {_human(v)}" for name, v in network_rows(r))
    comm.caption = (
        f"total {_human(r.comm_bytes_per_device)}: {split}; minimum for these layouts "
        f"{_human(r.min_comm_bytes_per_device)}"
    )
    console.print(comm)
    floor = r.step_floor
    if floor is not None:
        mfu = f"; MFU ceiling {r.mfu_ceiling:.1%}" if r.mfu_ceiling is not None else ""
        within, between = floor.networks
        dcn = f", {between} {floor.dcn_seconds * 1e3:.1f} ms" if floor.dcn_seconds else ""
        host = (
            f", host link {floor.host_link_seconds * 1e3:.1f} ms" if floor.host_link_seconds else ""
        )
        hbm = (
            f"; HBM roofline beside it {floor.hbm_seconds * 1e3:.1f} ms"
            if floor.hbm_seconds
            else ""
        )
        console.print(
            f"step-time floor {floor.seconds * 1e3:.1f} ms ({floor.bound}-bound: compute "
            f"{floor.compute_seconds * 1e3:.1f} ms for {floor.flops_per_device / 1e12:.2f} "
            f"TFLOP per {unit} at peak, {within} {floor.ici_seconds * 1e3:.1f} ms{dcn}{host})"
            f"{mfu}{hbm}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    if fit is not None:
        verdict = ("OK " if fit.fits else "NO ") + str(fit)
        console.print(verdict, highlight=False, markup=False, soft_wrap=True)
    for w in r.warnings[:5]:
        console.print(f"warning: {w}", highlight=False, markup=False, soft_wrap=True)
    return console.file.getvalue()  # type: ignore[attr-defined]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dtensor.aot",
        description="Compile a training script's step for a TPU or NVIDIA GPU topology (no TPU "
        "or GPU needed) and print its per-chip memory and communication.",
        epilog="Example: python -m dtensor.aot --topology v5e:4x4 --strategy fully_sharded "
        "-- examples/train.py --model-size small",
    )
    p.add_argument(
        "--topology",
        required=True,
        help="TPU: Cloud TPU's accelerator type (v5p-128, v5litepod-16, v6e-256, v4-128) or a "
        "generation and chip grid (v5p:4x4x4, v5e:4x4), described as Cloud TPU builds the slice "
        "(torus links, megacore); GPU: h100:2x8 (hosts x GPUs per "
        "host), h100:2x2x8 (slices x hosts x GPUs); models h100, h200, a100-80gb, b200",
    )
    p.add_argument(
        "--num-slices", type=int, default=1, help="slices joined by DCN / the network (default 1)"
    )
    p.add_argument("--strategy", help="passed on to the script as --strategy NAME")
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    p.add_argument("--full", action="store_true", help="print the whole explain report too")
    p.add_argument(
        "--fit",
        action="store_true",
        help="search the memory rungs (bf16; remat, then its dots_saveable policy; bf16 "
        "compute; scan, then scan with dots_saveable; optimizer offload; then hybrid with a "
        "tensor axis of 2, 4) for the fitting configuration with the lowest step-time floor, "
        "and print its command line (dtensor.tpu.fit; --search's memory-only mode)",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="search HybridStrategy plans (the six axes, across_slices, pipeline and context "
        "modes, memory rungs) for the fitting plan with the lowest step-time floor; give the "
        "model's flags only (dtensor.tpu.search_plans)",
    )
    p.add_argument(
        "--max-compiles",
        type=int,
        default=None,
        help="--search/--fit: compile at most this many plans (default 6 for --search)",
    )
    p.add_argument(
        "--degraded",
        action="store_true",
        help="--search/--fit with --num-slices N: also plan for N - 1 slices (a slice lost for "
        "good, the job going on with the same global batch), ahead of time; both searches' "
        "compiles are cached, so the restart's plan is known before it is needed",
    )
    p.add_argument("--cache-dir", help="--search/--fit: where compiled results are kept")
    p.add_argument(
        "--max-gib",
        type=float,
        help="--search/--fit: fit within this many GiB per chip (default: the chip's usable HBM)",
    )
    p.add_argument("script", nargs="?", help="the training script (or give it after --)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 fits, 1 will not fit, 2 usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = _parser()
    args, unknown = parser.parse_known_args(ours)
    script = args.script
    if script is None:
        if not rest:
            parser.print_usage(sys.stderr)
            print("error: give the training script, e.g. -- examples/train.py", file=sys.stderr)
            return 2
        script, rest = rest[0], rest[1:]
    script_argv = unknown + (["--strategy", args.strategy] if args.strategy else []) + rest
    if args.fit or args.search:
        return _search(script, script_argv, args)
    from dtensor.analysis.memory import WillNotFitError

    try:
        result = compile_script(
            script, script_argv, topology=args.topology, num_slices=args.num_slices
        )
    except WillNotFitError as e:
        print(f"dtensor.aot {script} {' '.join(script_argv)} on {args.topology}: NO {e}")
        if args.json:
            verdict = {"fits": False, "required_bytes": e.required, "available_bytes": e.available}
            _write(args.json, {**verdict, "error": str(e)[:600], "topology": args.topology})
        return 1
    except ValueError as e:  # AotError, TopologyError, and the script's own checks
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(result, title=f"dtensor.aot {script} {' '.join(script_argv)}".rstrip()))
    if args.full:
        print(result.report)
    fit = result.report.memory_fit
    if args.json:
        _write(args.json, {**result.to_dict(), "fits": fit is None or fit.fits})
    return 1 if fit is not None and not fit.fits else 0


def _write(path: str, payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, sort_keys=True, indent=1))


def _search(script: str, script_argv: list[str], args: argparse.Namespace) -> int:
    """``--search`` / ``--fit``: search, show the compiles, the ranked plans and the choice."""
    from dtensor.tpu.search import fit, search_plans
    from dtensor.tpu.views import CompileProgress, render

    mode = "search" if args.search else "fit"
    if args.degraded and args.num_slices < 2:
        print(
            f"error: --degraded plans for one slice fewer than --num-slices {args.num_slices}; "
            "give --num-slices 2 or more",
            file=sys.stderr,
        )
        return 2
    counts = [args.num_slices, args.num_slices - 1] if args.degraded else [args.num_slices]
    results = {}
    for slices in counts:
        where = args.topology + (f" x {slices} slices" if slices > 1 else "")
        lead = "degraded, " if slices < args.num_slices else ""
        print(
            f"dtensor.aot --{mode}: {lead}{script} {' '.join(script_argv)} on {where}", flush=True
        )
        options: dict[str, Any] = {
            "topology": args.topology,
            "num_slices": slices,
            "cache_dir": args.cache_dir,
            "max_bytes_per_chip": None if args.max_gib is None else args.max_gib * (1 << 30),
        }
        if args.max_compiles is not None:
            options["max_compiles"] = args.max_compiles
        try:
            with CompileProgress() as progress:
                run = search_plans if args.search else fit
                found = run(script, script_argv, progress=progress, **options)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(render(found), end="")
        results[slices] = found
    if args.json:
        if args.degraded:
            _write(args.json, {str(n): f.to_dict() for n, f in results.items()})
        else:
            _write(args.json, results[args.num_slices].to_dict())
    return 0 if all(f.best is not None for f in results.values()) else 1


def cli() -> int:
    """The command line `python -m dtensor.aot`: selects the CPU platform unless JAX_PLATFORMS says otherwise."""
    import jax

    if not os.environ.get("JAX_PLATFORMS"):
        # Compiling for a topology needs no accelerator; do not let JAX probe for one.
        jax.config.update("jax_platforms", "cpu")
    return main()


if __name__ == "__main__":
    sys.exit(cli())
