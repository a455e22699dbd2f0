"""`Report`: what :func:`dtensor.explain` found in a compiled step, as values and as text."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from dtensor.analysis.hlo import Collective
from dtensor.core.layout import Layout
from dtensor.core.text import human_bytes, render

__all__ = ["Finding", "Report", "VariableInfo", "layout_text", "memory_rows", "network_rows"]


@dataclasses.dataclass(frozen=True, slots=True)
class VariableInfo:
    """One variable leaf: where it lives and what it costs per device."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    layout: str
    rule: str | None
    bytes_per_device: int
    global_bytes: int
    trainable: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with sorted keys."""
        return dict(sorted({**dataclasses.asdict(self), "shape": list(self.shape)}.items()))


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """A warning: ``kind`` is ``replicated``, ``unmatched``, ``silent-replication`` or
    ``full-size-reduction``."""

    kind: str
    path: str
    message: str

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with sorted keys."""
        return {"kind": self.kind, "message": self.message, "path": self.path}


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`explain` found; ``str(report)`` renders tables, ``to_dict()`` JSON.

    Byte figures are per device. ``comm_bytes_per_device`` sums
    ``bytes_per_device * count`` over ``collectives``; the memory figures are
    XLA's (``None`` when the backend gives no ``memory_analysis``), and
    ``argument_bytes_per_device`` includes the batch.
    ``state_bytes_per_device`` is what the variables occupy in their layouts;
    ``ideal_state_bytes_per_device`` what they would occupy split evenly over
    all devices of the mesh.

    On TPU meshes ``ici_bytes_per_device`` / ``dcn_bytes_per_device`` split
    the communication between the network inside a slice and the one between
    slices (``None`` elsewhere); on GPU meshes ``nvlink_bytes_per_device`` /
    ``ib_bytes_per_device`` split it between NVLink (inside a host) and the
    network between hosts (InfiniBand or RoCE). ``memory_fit`` holds the
    per-chip memory against the chip's HBM (a
    :class:`dtensor.analysis.memory.MemoryFit`, ``None`` when the chip is not
    known).

    ``peak_bytes_per_device`` is XLA's peak, ``arguments + temporaries +
    outputs - aliased`` (``None`` without a memory analysis);
    ``min_comm_references`` names the two references the minimum is the lower
    of (``None`` when no variable is split over the data axes): the weights
    gathered (ZeRO) and, per matmul, the cheaper of moving the weight or the
    activations (:mod:`dtensor.analysis.minimum`); each counts the variables
    not split over the data axes the same way, and neither the caller's
    ``activation_bytes_min``.
    ``step_floor`` (a :class:`dtensor.analysis.floor.StepFloor`, ``None`` for
    a chip not in :data:`dtensor.analysis.hardware.CHIPS`) gives
    ``step_time_floor_seconds``; with ``model_flops`` (one call's model
    FLOPs) it gives ``mfu_ceiling``.
    ``ideal_peak_bytes_per_device`` the ZeRO formula's for the preset,
    ``state + gradients + two largest gathered variables + activations (as
    remat leaves them) + batch``, per device, and ``ideal_peak_terms`` its
    terms (a :class:`dtensor.analysis.peak.PeakTerms`; the formula and how
    each term is measured are in :mod:`dtensor.analysis.peak`).
    A mixture of experts' token dispatch (:func:`dtensor.expert_mlp`):
    ``dispatch_bytes_per_device`` its all-to-alls over the expert axis in the
    compiled program, ``dispatch_min_bytes_per_device`` what they must move
    (the rows routed, ``(n-1)/n`` of them off the device when balanced; part
    of ``min_comm_bytes_per_device``), ``dispatch_capacity`` the rows its
    receive buffers hold per row routed (``n``, the expert-parallel size, for
    dropless routing: any imbalance fits), ``None`` without a dispatch
    (:func:`dtensor.analysis.minimum.dispatch_minimum`).
    ``context_bytes_per_device``: what :func:`dtensor.context_attention` moves
    over the ``context`` axis (its K/V all-gathers or ring permutes and the
    load-balancing permutes, forward and backward: the collectives under its
    name scope, and the K/V gradients' all-reduce over ``context`` that
    libtpu makes of their reduce-scatter without the scope), part of
    ``comm_bytes_per_device`` (0 without a context axis).
    A pipeline over a ``stage`` axis (:func:`dtensor.core.pipeline.pipeline`):
    ``stage_bytes_per_device`` the collective permutes over ``stage`` (the
    activations passed from stage to stage, forward and backward),
    ``stage_bytes_by_network`` the same by network (``(("dcn", bytes),
    ("ici", bytes))`` on a multi-slice topology; empty where the devices have
    no network model), ``pipeline_schedule`` the schedule in words and
    ``bubble_fraction`` its idle fraction, ``(S - 1) / (R M + S - 1)`` for
    GPipe and circular, by the tick table for 1F1B, interleaved 1F1B and
    zero-bubble (:attr:`dtensor.core.schedules.Schedule.bubble_fraction`; 0
    without a pipeline; set by the strategy that pipelined the step). The idle
    stages' computation is in the compiled program, so ``step_floor`` (its
    FLOPs at the chip's peak) includes the bubble.
    """

    collectives: tuple[Collective, ...]
    comm_bytes_per_device: float
    min_comm_bytes_per_device: float
    argument_bytes_per_device: int | None
    output_bytes_per_device: int | None
    temp_bytes_per_device: int | None
    alias_bytes_per_device: int | None
    state_bytes_per_device: int
    ideal_state_bytes_per_device: int
    variables: tuple[VariableInfo, ...]
    warnings: tuple[Finding, ...]
    mesh: str
    data_axes: tuple[str, ...]
    compiled: Any = dataclasses.field(default=None, repr=False, compare=False)
    ici_bytes_per_device: float | None = None
    dcn_bytes_per_device: float | None = None
    memory_fit: Any = None
    nvlink_bytes_per_device: float | None = None
    ib_bytes_per_device: float | None = None
    peak_bytes_per_device: int | None = None
    ideal_peak_bytes_per_device: int | None = None
    ideal_peak_terms: Any = None
    min_comm_references: dict[str, float] | None = None
    step_floor: Any = None
    model_flops: float | None = None
    dispatch_bytes_per_device: float = 0.0
    dispatch_min_bytes_per_device: float = 0.0
    dispatch_capacity: float | None = None
    context_bytes_per_device: float = 0.0
    stage_bytes_per_device: float = 0.0
    stage_bytes_by_network: tuple[tuple[str, float], ...] = ()
    bubble_fraction: float = 0.0
    pipeline_schedule: str = ""

    @property
    def step_time_floor_seconds(self) -> float | None:
        """The step's time floor on its chip (``step_floor.seconds``; ``None`` off the
        hardware table): its matmul FLOPs at peak, or its collectives at ICI/DCN bandwidth,
        whichever is larger (:mod:`dtensor.analysis.floor`)."""
        return None if self.step_floor is None else self.step_floor.seconds

    @property
    def mfu_ceiling(self) -> float | None:
        """The model-FLOPs utilisation the floor allows (``None`` without ``model_flops``)."""
        if self.step_floor is None or not self.model_flops or not self.step_floor.seconds:
            return None
        return self.step_floor.mfu_ceiling(self.model_flops)

    def with_model_flops(self, model_flops: float) -> Report:
        """This report with ``model_flops`` (one step's ``6 x params x tokens`` + attention)."""
        return dataclasses.replace(self, model_flops=float(model_flops))

    @property
    def peak_ratio(self) -> float | None:
        """``peak / ideal peak`` (``None`` when either is unknown)."""
        if not self.peak_bytes_per_device or not self.ideal_peak_bytes_per_device:
            return None
        return self.peak_bytes_per_device / self.ideal_peak_bytes_per_device

    @property
    def comm_ratio(self) -> float:
        """``comm / min`` (1.0 when both are 0, ``inf`` when only the minimum is)."""
        if self.min_comm_bytes_per_device == 0:
            return 1.0 if self.comm_bytes_per_device == 0 else math.inf
        return self.comm_bytes_per_device / self.min_comm_bytes_per_device

    def by_kind(self) -> dict[str, float]:
        """Bytes per device for each collective kind present."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.total_bytes_per_device
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, deterministic (sorted keys; ``comm_ratio`` ``None`` if infinite)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del d["compiled"]
        ratio = self.comm_ratio
        d.update(
            collectives=[c.to_dict() for c in self.collectives],
            comm_ratio=None if math.isinf(ratio) else ratio,
            data_axes=list(self.data_axes),
            memory_fit=None if self.memory_fit is None else self.memory_fit.to_dict(),
            ideal_peak_terms=(
                None
                if self.ideal_peak_terms is None
                else dict(
                    sorted(
                        (
                            dataclasses.asdict(self.ideal_peak_terms)
                            | {"gathered": list(self.ideal_peak_terms.gathered)}
                        ).items()
                    )
                )
            ),
            peak_ratio=self.peak_ratio,
            step_floor=None if self.step_floor is None else self.step_floor.to_dict(),
            step_time_floor_seconds=self.step_time_floor_seconds,
            mfu_ceiling=self.mfu_ceiling,
            min_comm_references=(
                None
                if self.min_comm_references is None
                else dict(sorted(self.min_comm_references.items()))
            ),
            stage_bytes_by_network=dict(self.stage_bytes_by_network),
            variables=[v.to_dict() for v in self.variables],
            warnings=[w.to_dict() for w in self.warnings],
        )
        return dict(sorted(d.items()))

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict(), sort_keys=True, ...)``."""
        return json.dumps(self.to_dict(), sort_keys=True, **kwargs)

    def __str__(self) -> str:
        return _render(self)


def layout_text(layout: Layout | None, sharding: Any = None) -> str:
    """A layout's specs as ``[x, unsharded]`` (tuples of axes as ``(a,b)``)."""
    if layout is None:
        return str(sharding)
    parts = [s if isinstance(s, str) else "(" + ",".join(s) + ")" for s in layout.sharding_specs]
    text = "[" + ", ".join(parts) + "]"
    return text + (f" partial{list(layout.partial_axes)}" if layout.partial_axes else "")


def memory_rows(report: Report) -> list[tuple[str, float | None]]:
    """The memory figures per device, and per chip against its HBM when the report has a fit.

    One list for every renderer (``str(report)`` and ``python -m dtensor.aot``);
    ``None`` marks a heading row without a figure.

    Examples:
        >>> import dtensor, jax, jax.numpy as jnp
        >>> from dtensor.analysis.report import memory_rows
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=dtensor.Layout(["x", None], mesh).sharding)
        >>> rows = memory_rows(dtensor.explain(lambda x: x.sum(), x))
        >>> rows[0], [name for name, _ in rows][1:4]
        (('arguments (incl. batch)', 1024), ['outputs', 'aliased (donated)', 'temporaries'])
    """
    fit = report.memory_fit
    rows: list[tuple[str, float | None]] = [
        ("arguments (incl. batch)", report.argument_bytes_per_device),
        ("outputs", report.output_bytes_per_device),
        ("aliased (donated)", report.alias_bytes_per_device),
        ("temporaries", report.temp_bytes_per_device),
    ]
    if fit is not None:
        rows.append(("code", fit.code_bytes))
        if fit.devices_per_chip > 1:
            rows.append((f"per device x {fit.devices_per_chip} TensorCores", None))
        rows.append((f"peak per {fit.unit}", fit.bytes_per_chip))
        rows.append((f"HBM of a {fit.chip} {fit.unit}", fit.hbm_bytes_per_chip))
        share = fit.limit_bytes_per_chip / fit.hbm_bytes_per_chip
        by = f"JAX's allocator, {share:.0%}" if fit.unit == "GPU" else "libtpu"
        rows.append((f"usable by one program ({by})", fit.limit_bytes_per_chip))
    rows += [
        ("state (variables)", report.state_bytes_per_device),
        ("state, ideally sharded", report.ideal_state_bytes_per_device),
        ("peak (args + temps + outputs - aliased)", report.peak_bytes_per_device),
        ("peak, ideally (ZeRO formula)", report.ideal_peak_bytes_per_device),
    ]
    return rows


def network_rows(report: Report) -> list[tuple[str, float]]:
    """Communication per device split by network: ICI/DCN on TPUs, NVLink/InfiniBand on
    GPUs (none on CPU).

    Examples:
        >>> import dtensor, jax, jax.numpy as jnp
        >>> from dtensor.analysis.report import network_rows
        >>> mesh = dtensor.create_mesh([("x", 8)], devices=dtensor.tpu_topology("v5e:2x4"))
        >>> x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=dtensor.Layout(["x", None], mesh).sharding)
        >>> network_rows(dtensor.explain(lambda x: x.sum(), x))
        [('ICI (within slices)', 7.0), ('DCN (between slices)', 0.0)]
    """
    nets = [
        ("ICI (within slices)", report.ici_bytes_per_device),
        ("DCN (between slices)", report.dcn_bytes_per_device),
        ("NVLink (within hosts)", report.nvlink_bytes_per_device),
        ("InfiniBand/RoCE (between hosts)", report.ib_bytes_per_device),
    ]
    return [(name, value) for name, value in nets if value is not None]


def _render(report: Report) -> str:
    parts: list[Any] = []
    ratio = report.comm_ratio
    summary = Table(title=f"dtensor.explain on {report.mesh or 'one device'}", show_header=False)
    summary.add_column("figure")
    summary.add_column("per device", justify="right")
    rows = [
        ("communication", human_bytes(report.comm_bytes_per_device)),
        *((f"  over {k}", human_bytes(v)) for k, v in network_rows(report)),
        ("minimum for these layouts", human_bytes(report.min_comm_bytes_per_device)),
        ("communication / minimum", "-" if math.isinf(ratio) else f"{ratio:.3f}"),
        *((k, "" if v is None else human_bytes(v)) for k, v in memory_rows(report)),
        ("data axes", ", ".join(report.data_axes) or "-"),
    ]
    for name, value in (report.min_comm_references or {}).items():
        rows.insert(3, (f"  reference: {name}", human_bytes(value)))
    if report.dispatch_capacity is not None:
        at = 1 + len(network_rows(report))
        rows[at:at] = [
            (
                "  MoE dispatch (all-to-all over expert)",
                human_bytes(report.dispatch_bytes_per_device),
            ),
            ("  MoE dispatch, minimum", human_bytes(report.dispatch_min_bytes_per_device)),
            ("  MoE receive buffers / rows routed", f"{report.dispatch_capacity:.0f}x (dropless)"),
        ]
    if report.context_bytes_per_device:
        at = 1 + len(network_rows(report))
        rows.insert(
            at,
            ("  attention over context (K/V)", human_bytes(report.context_bytes_per_device)),
        )
    if report.stage_bytes_per_device:
        at = 1 + len(network_rows(report))
        nets = ", ".join(f"{k} {human_bytes(v)}" for k, v in report.stage_bytes_by_network)
        rows.insert(
            at,
            (
                "  pipeline permutes over stage" + (f" ({nets})" if nets else ""),
                human_bytes(report.stage_bytes_per_device),
            ),
        )
    if report.pipeline_schedule:
        rows.append(("pipeline", report.pipeline_schedule))
        rows.append(("  bubble (idle fraction)", f"{report.bubble_fraction:.1%}"))
    floor = report.step_floor
    if floor is not None:
        rows.append((f"step-time floor ({floor.bound}-bound)", f"{floor.seconds * 1e3:.1f} ms"))
        if floor.hbm_seconds:
            rows.append(("  HBM roofline (beside it)", f"{floor.hbm_seconds * 1e3:.1f} ms"))
        if floor.host_link_seconds:
            rows.append(("  host link (offloads)", f"{floor.host_link_seconds * 1e3:.1f} ms"))
        if report.mfu_ceiling is not None:
            rows.append(("MFU ceiling", f"{report.mfu_ceiling:.1%}"))
    for k, v in rows:
        summary.add_row(k, v)
    parts.append(summary)
    if report.memory_fit is not None:
        parts.append(Text(str(report.memory_fit)))

    coll = Table(title="Collectives")
    for name in ("kind", "mesh axes", "dtype", "shape", "group", "runs", "ops", "bytes/device"):
        coll.add_column(
            name, justify="right" if name in ("group", "runs", "ops", "bytes/device") else "left"
        )
    merged: dict[tuple[Any, ...], list[float]] = {}
    for c in report.collectives:
        key = (c.kind, c.network, c.mesh_axes, c.dtype, c.shape, c.group_size, c.count)
        merged.setdefault(key, []).append(c.total_bytes_per_device)
    for (kind, network, axes, dtype, shape, n, count), b in merged.items():
        cells = (
            f"{kind} ({network})" if network else kind,
            ",".join(axes) or "-",
            dtype,
            str(list(shape)),
            str(n),
            str(count),
            str(len(b)),
            human_bytes(sum(b)),
        )
        coll.add_row(*map(escape, cells))
    parts.append(coll)

    var = Table(title="Variables")
    for name in ("path", "shape", "dtype", "layout", "rule", "bytes/device"):
        var.add_column(name, justify="right" if name == "bytes/device" else "left")
    for v in report.variables:
        cells = (
            v.path,
            str(list(v.shape)),
            v.dtype,
            v.layout,
            v.rule or "-",
            human_bytes(v.bytes_per_device),
        )
        var.add_row(*map(escape, cells))
    parts.append(var)
    if report.warnings:
        parts.append(Text("Warnings:"))
        parts.extend(Text(f"  [{w.kind}] {w.message}") for w in report.warnings)
    return render(Group(*parts), width=120)
