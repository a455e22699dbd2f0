"""How fast a compiled step can run at best: its step-time floor and MFU ceiling.

The floor is the larger of

- compute: the step's matmul FLOPs per device at the chip's peak bf16 rate
  (:data:`dtensor.analysis.hardware.CHIPS`);
- communication: its collectives' bytes per device (as :func:`dtensor.explain`
  reads them from the compiled program, loops counted once per iteration)
  over the chip's ICI egress bandwidth, and those between slices over its
  DCN share (the two networks overlap, so the larger of the two). On NVIDIA
  GPUs the two networks are NVLink (within a host) and the GPU's
  InfiniBand/RoCE NIC (between hosts). A collective whose groups span ``h``
  hosts, ``g`` of a group's GPUs in each, must bring at least ``(h-1)/h`` of
  its data into each host over those GPUs' ``g`` NICs (an all-reduce twice),
  whatever NCCL's algorithm (ring, tree, hierarchical): the between-hosts term
  takes that, ``ring bytes x (h-1)/h / ((n-1)/n) / g``, not the ring bytes
  (which would charge every byte of a 64-GPU all-gather to the network);
- host link: the bytes a device moves between its memory and host memory
  (activations a ``remat_policy`` offloads, read from the compiled program by
  :mod:`dtensor.analysis.host_link`), the larger direction, over the chip's
  link to its host (each direction at once; the copies are asynchronous, so
  they overlap compute and the floor takes the larger, not the sum). No
  figure for GPUs yet: there the term is left out.

The FLOPs are counted on the step's jaxpr, every ``dot_general`` at
``2 * output elements * contracted size``: the forward pass, the backward
pass and the rematerialised recomputation each appear there, a scanned
body counts ``length`` times, a ``shard_map`` body (one device's) once per
device of its manual axes and a Pallas kernel (one grid step's) once per
grid step, masked blocks included; a grouped-matmul kernel whose row tiles
are known only at run time (megablox's ``gmm`` / ``tgmm``, MaxText's MoE) at
``2 x m x k x n`` from its shapes (:func:`uncounted_kernels` lists any other
kernel with a run-time grid, whose dynamic factor is not counted). (libtpu's ``cost_analysis()`` counts a loop's
body once, and its ``optimal_seconds`` came out negative for a scanned
Gemma step, so it is not used.) Elementwise work and the time a matmul
waits for memory are left out of the floor: the floor errs low.

Beside the floor, ``hbm_seconds`` is the compiled program's HBM roofline
(:mod:`dtensor.analysis.roofline`: each kernel's bytes at the chip's memory
bandwidth against its matmul FLOPs at peak, the larger of the two, summed over
the kernels as they run). It is reported, not yet part of ``seconds``: on
Llama 2 70B (v5p:4x4x4, fsdp=32 tensor=2, bf16 + full remat + scan) it reads
1810 ms against 1165 ms of compute, the bytes of weights read again for each
chunk of tokens of libtpu's looped matmuls and of copies of the stacked
gradients inside the layer loop; until those readings are held against steps
measured on TPUs, the floor leaves the term out rather than risk not being a
bound.

The MFU ceiling is the model FLOPs of one step (``6 x parameters x tokens``
plus attention, supplied by the caller) over ``devices x peak x floor``: the
model-FLOPs utilisation no run of this program can exceed. Rematerialisation
raises the compute floor (its recomputed matmuls are counted) and so lowers
the ceiling.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from dtensor.analysis.hardware import Chip, chip_of
from dtensor.analysis.roofline import hbm_roofline

__all__ = [
    "StepFloor",
    "between_hosts_bytes",
    "floor_for",
    "matmul_flops",
    "step_floor",
    "uncounted_kernels",
]


@dataclasses.dataclass(frozen=True, slots=True)
class StepFloor:
    """The terms of a step-time floor, in seconds (``dcn_seconds`` ``None``: no DCN figure)."""

    flops_per_device: float
    compute_seconds: float
    ici_seconds: float
    dcn_seconds: float | None
    chip: str
    devices: int = 1
    peak_flops: float = 0.0
    networks: tuple[str, str] = ("ICI", "DCN")
    host_link_seconds: float = 0.0
    host_link_bytes_per_s: float | None = None
    hbm_seconds: float = 0.0
    hbm_bytes: float = 0.0

    @property
    def seconds(self) -> float:
        """The floor: the larger of compute, communication and the host link (the HBM
        roofline is reported beside it, not yet in it: see the module docs)."""
        return max(
            self.compute_seconds,
            self.ici_seconds,
            self.dcn_seconds or 0.0,
            self.host_link_seconds,
        )

    @property
    def bound(self) -> str:
        """What sets the floor: ``"compute"`` or a network's name (``"ICI"``, ``"DCN"``;
        ``"NVLink"``, ``"IB"`` on GPUs)."""
        within, between = self.networks
        terms = {"compute": self.compute_seconds, within: self.ici_seconds}
        terms[between] = self.dcn_seconds or 0.0
        terms["host link"] = self.host_link_seconds
        return max(terms, key=lambda k: terms[k])

    def mfu_ceiling(self, model_flops: float) -> float:
        """``model_flops / (devices x peak x seconds)``: the utilisation no run can exceed."""
        return model_flops / (self.devices * self.peak_flops * self.seconds)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with sorted keys (the fields, ``seconds`` and ``bound``)."""
        d = dataclasses.asdict(self)
        d.update(seconds=self.seconds, bound=self.bound)
        return dict(sorted(d.items()))


def matmul_flops(jaxpr: Any) -> float:
    """The FLOPs of every ``dot_general`` (and grouped ``ragged_dot``) in a (closed) jaxpr,
    nested calls and scans included.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from dtensor.analysis.floor import matmul_flops
        >>> x = jnp.zeros((8, 16)); w = jnp.zeros((16, 32))
        >>> matmul_flops(jax.make_jaxpr(lambda x, w: x @ w)(x, w))   # 2 * 8*32 * 16
        8192.0
        >>> step = jax.make_jaxpr(jax.grad(lambda w, x: ((x @ w) ** 2).sum()))(w, x)
        >>> matmul_flops(step)   # forward x @ w, then dW = x.T @ dy
        16384.0
        >>> scan = lambda w, x: jax.lax.scan(lambda c, _: (c @ w[:, :16], None), x, None, 5)[0]
        >>> matmul_flops(jax.make_jaxpr(scan)(w, x))   # 5 iterations of 2 * 8*16 * 16
        20480.0
        >>> experts = jnp.zeros((4, 16, 32)); sizes = jnp.asarray([2, 2, 2, 2])
        >>> matmul_flops(jax.make_jaxpr(jax.lax.ragged_dot)(x, experts, sizes))  # each row one expert
        8192.0
    """
    return _flops(getattr(jaxpr, "jaxpr", jaxpr))


def _flops(jaxpr: Any) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)
            continue
        if eqn.primitive.name == "ragged_dot_general":  # a grouped matmul (MoE experts)
            total += _ragged_flops(eqn)
            continue
        if eqn.primitive.name in _FUSED_ATTENTION:  # cuDNN's (jax.nn.dot_product_attention)
            total += _fused_attention_flops(eqn)
            continue
        if eqn.primitive.name == "pallas_call" and _dynamic_grid(eqn):
            grouped = _grouped_kernel_flops(eqn)
            if grouped is not None:  # megablox's gmm / tgmm: the grouped matmul's own FLOPs
                total += grouped
                continue
        times = _repeats(eqn)
        subs = []
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    subs.append(inner)
        if eqn.primitive.name == "cond":  # one branch runs: count the dearest
            total += max((_flops(s) for s in subs), default=0.0)
        else:
            total += times * sum(_flops(s) for s in subs)
    return total


def _ragged_flops(eqn: Any) -> float:
    """A grouped matmul's FLOPs: each lhs element meets one group's rhs, ``2 x |lhs| x |rhs|
    / (contracted x groups)`` (forward ``[m,k] x [g,k,n]``, and its gradients, alike)."""
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (_, rhs_contract), _ = numbers.dot_dimension_numbers
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    shared = math.prod(rhs[d] for d in (*rhs_contract, *numbers.rhs_group_dimensions))
    flops = 2.0 * math.prod(lhs) * math.prod(rhs) / max(shared, 1)
    # Over an expert-parallel receive buffer (dtensor.expert_mlp's ``grouped_k{k}_of{held}``
    # scope) only the rows routed are computed: k of every ``held`` rows.
    routed = re.search(r"grouped_k(\d+)_of(\d+)", str(eqn.source_info.name_stack))
    return flops * int(routed.group(1)) / int(routed.group(2)) if routed else flops


#: jax.nn.dot_product_attention(implementation="cudnn")'s primitives: their matmuls per
#: forward's two (``q k^T`` and ``p v``): the backward recomputes ``p`` and forms dv, dp, dq, dk.
_FUSED_ATTENTION = {"dot_product_attention_fwd_wrapper": 2, "dot_product_attention_bwd_wrapper": 5}


def _fused_attention_flops(eqn: Any) -> float:
    """A fused attention's FLOPs: ``2 x batch x q_len x kv_len x heads x head_dim`` a matmul,
    halved for a causal mask (the kernel skips the blocks above the diagonal)."""
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    b, t, n, h = q  # BTNH, the layout jax.nn.dot_product_attention passes
    flops = 2.0 * b * t * k[1] * n * h * _FUSED_ATTENTION[eqn.primitive.name]
    return flops / 2 if "CAUSAL" in str(eqn.params.get("mask_type", "")).upper() else flops


def _dynamic_grid(eqn: Any) -> bool:
    """Whether a ``pallas_call``'s grid has a dimension known only at run time."""
    grid = getattr(eqn.params.get("grid_mapping"), "grid", ()) or ()
    return any(not isinstance(g, int) for g in grid)


def _grouped_kernel_flops(eqn: Any) -> float | None:
    """A grouped-matmul kernel's FLOPs (``2 x m x k x n``) from its arrays' shapes, or ``None``.

    Megablox's ``gmm`` (``[m, k] x [g, k, n] -> [m, n]``) and ``tgmm`` (``[m, k]`` and
    ``[m, n]`` -> ``[g, k, n]``), as MaxText's dropless MoE calls them, run a grid whose
    row-tile count is data-dependent (a ``DynamicGridDim``): one grid step's matmul times
    the static dimensions alone misses that factor (a quarter of the FLOPs at 4 row tiles).
    Every row meets one group's ``k x n`` block, so the kernel's work is ``2 x m x k x n``
    whatever the grouping. A kernel whose arrays are not one ``[g, a, b]`` and two ``[m, *]``
    matrices spanning ``a`` and ``b`` is not recognised (``None``)."""
    arrays = [v.aval.shape for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "shape")]
    cubes = [s for s in arrays if len(s) == 3]
    mats = [s for s in arrays if len(s) == 2]
    if len(cubes) != 1 or len(mats) != 2:
        return None
    _, a, b = cubes[0]
    (m1, p), (m2, q) = mats
    if m1 != m2 or {p, q} != {a, b}:
        return None
    return 2.0 * m1 * a * b


def uncounted_kernels(jaxpr: Any) -> list[str]:
    """The ``pallas_call`` kernels whose matmuls :func:`matmul_flops` cannot count in full:
    a grid dimension known only at run time in a kernel that is no grouped matmul it
    recognises (their static grid dimensions are counted, the dynamic one is not).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from dtensor.analysis.floor import uncounted_kernels
        >>> uncounted_kernels(jax.make_jaxpr(jnp.dot)(jnp.ones((4, 4)), jnp.ones((4, 4))))
        []
    """
    found: list[str] = []

    def walk(j: Any) -> None:
        for eqn in j.eqns:
            if eqn.primitive.name == "pallas_call" and _dynamic_grid(eqn):
                if _grouped_kernel_flops(eqn) is None:
                    shapes = [tuple(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape")]
                    found.append(f"pallas_call {eqn.params.get('name_and_src_info')} {shapes}")
                continue
            for value in eqn.params.values():
                for item in value if isinstance(value, tuple | list) else (value,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(getattr(jaxpr, "jaxpr", jaxpr))
    return found


def _repeats(eqn: Any) -> int:
    """How many times an equation's inner jaxprs run, in units of the whole program: a
    scan's ``length``; a ``shard_map`` body is one device's share (times the devices of
    its newly manual axes); a ``pallas_call`` kernel body is one grid step's (times the
    grid: Splash attention's matmuls, for one)."""
    name = eqn.primitive.name
    if name == "scan":
        return int(eqn.params.get("length", 1))
    if name == "shard_map":
        sizes = dict(getattr(eqn.params.get("mesh"), "shape", {}) or {})
        return math.prod(int(sizes.get(a, 1)) for a in eqn.params.get("newly_manual_axes", ()))
    if name == "pallas_call":
        grid = getattr(eqn.params.get("grid_mapping"), "grid", ()) or ()
        return math.prod(int(g) for g in grid if isinstance(g, int))
    return 1


def step_floor(
    flops_per_device: float,
    ici_bytes_per_device: float,
    dcn_bytes_per_device: float,
    chip: Chip,
    *,
    devices: int = 1,
    host_bytes_per_device: float = 0.0,
    roofline: Any = None,
) -> StepFloor:
    """The floor of a step on ``chip`` (see the module docs).

    Examples:
        >>> from dtensor.analysis.floor import step_floor
        >>> from dtensor.analysis.hardware import CHIPS
        >>> f = step_floor(197e12, 100e9, 0.0, CHIPS["TPU v5 lite"])   # 1 s of compute, 0.5 s ICI
        >>> f.seconds, f.bound
        (1.0, 'compute')
    """
    dcn = None if chip.dcn_bytes_per_s is None else dcn_bytes_per_device / chip.dcn_bytes_per_s
    return StepFloor(
        flops_per_device=float(flops_per_device),
        compute_seconds=flops_per_device / chip.peak_flops,
        ici_seconds=ici_bytes_per_device / chip.ici_bytes_per_s,
        dcn_seconds=dcn,
        chip=chip.generation,
        devices=int(devices),
        peak_flops=chip.peak_flops,
        networks=chip.networks,
        host_link_seconds=(
            host_bytes_per_device / chip.host_bytes_per_s if chip.host_bytes_per_s else 0.0
        ),
        host_link_bytes_per_s=chip.host_bytes_per_s,
        hbm_seconds=0.0 if roofline is None else roofline.seconds,
        hbm_bytes=0.0 if roofline is None else roofline.bytes,
    )


def floor_for(
    jaxpr: Any,
    collectives: Any,
    dcn_bytes: float | None,
    mesh: Any,
    *,
    host_bytes: float = 0.0,
    hlo_text: str | None = None,
) -> StepFloor | None:
    """The floor of a compiled step on its mesh's chip (``None`` for a chip not in the
    hardware table, or without a jaxpr): ``collectives`` are its
    :class:`dtensor.analysis.hlo.Collective` s, ``dcn_bytes`` those that cross slices
    (on GPUs: hosts), ``host_bytes`` what a device moves to or from host memory (the larger
    direction); ``hlo_text`` the compiled program, for the HBM roofline where the chip's
    memory bandwidth is known."""
    chip = chip_of(mesh.device_list) if mesh is not None else None
    if chip is None or jaxpr is None or mesh is None:
        return None
    total = float(sum(c.total_bytes_per_device for c in collectives))
    flops = matmul_flops(jaxpr) / mesh.size
    roofline = (
        hbm_roofline(hlo_text, chip.hbm_bytes_per_s, chip.peak_flops)
        if hlo_text and chip.hbm_bytes_per_s
        else None
    )
    if chip.networks == ("NVLink", "IB"):
        ib = [c for c in collectives if c.network == "ib"]
        within = total - sum(c.total_bytes_per_device for c in ib)
        between = sum(between_hosts_bytes(c, mesh) for c in ib)
        return step_floor(
            flops,
            within,
            between,
            chip,
            devices=mesh.size,
            host_bytes_per_device=host_bytes,
            roofline=roofline,
        )
    dcn = dcn_bytes or 0.0
    return step_floor(
        flops,
        total - dcn,
        dcn,
        chip,
        devices=mesh.size,
        host_bytes_per_device=host_bytes,
        roofline=roofline,
    )


def between_hosts_bytes(collective: Any, mesh: Any) -> float:
    """What one GPU's NIC must carry for ``collective`` (all executions) at least: its ring
    bytes scaled to ``(h-1)/h`` of the data entering each of the ``h`` hosts its groups span,
    shared by the group's ``g`` GPUs in each (see the module docs); all-to-all and
    collective-permute keep their ring bytes over ``(h-1)/h`` (each GPU sends its own).

    Examples:
        >>> import dtensor
        >>> from dtensor.analysis.collective import Collective
        >>> from dtensor.analysis.floor import between_hosts_bytes
        >>> mesh = dtensor.create_mesh([("fsdp", 16)], devices=dtensor.gpu_topology("h100:2x8"))
        >>> c = Collective("all-gather", ("fsdp",), "bf16", (1024,), 16, 15 / 16 * 2048)
        >>> between_hosts_bytes(c, mesh)   # 1/2 of the 2 KiB enters each host, over 8 NICs
        128.0
    """
    sizes = mesh.shape
    axes = [a for a in collective.mesh_axes if a in sizes] or list(sizes)
    hosts = np.array([int(d.process_index) for d in mesh.device_list]).reshape(
        [sizes[a] for a in mesh.dim_names]
    )
    group = hosts[tuple(slice(None) if a in axes else 0 for a in mesh.dim_names)].ravel()
    n, h = group.size, len(set(group.tolist()))
    if n <= 1 or h <= 1:
        return 0.0
    share = ((h - 1) / h) / ((n - 1) / n)
    if collective.kind in ("all-gather", "reduce-scatter", "all-reduce"):
        share /= n / h  # g GPUs of the group in each host, each with its own NIC
    return collective.total_bytes_per_device * share
