"""An analytic model of a plan's per-chip memory and step-time floor, before any compile.

``python -m dtensor.aot --search`` ranks thousands of plans (:mod:`dtensor.tpu.plans`) by
:func:`estimate` and compiles only the most promising few. The model, per device:

Memory (bytes):

- **state**, the ZeRO formula: float32 parameters (4 bytes) and Adam's two moments (8; on
  the host with ``offload``) and float32 gradients (4), each split over every axis that
  shards it (all but ``data``; the embeddings not over ``stage``);
- **gathered weights**: with weights split over ``fsdp x context x expert``, a layer's
  weights at a time in the compute dtype (the one read and the next, prefetched; every
  layer of the stage when the gathered weights are kept for the backward pass) and its
  float32 gradient before it is reduce-scattered, and the embeddings;
- **activations**: for each of the stage's layers, what the backward pass needs, by the remat
  rung (``full``: the block input, split along the sequence over ``tensor`` under
  ``HybridStrategy``'s sequence parallelism; ``dots_saveable``: every matmul output; ``none``:
  everything, with XLA attention's ``[heads, seq, seq]`` scores; an offloading plan,
  :data:`OFFLOADED`: the block input, its named tensors in host memory) over the device's tokens
  (the batch over ``data x fsdp x expert``, the sequence over ``context``), plus one layer's
  working set (recomputed) or the logits (float32, and in the compute dtype; one slice of
  them with ``--loss-chunks``), whichever is larger.

Floor (seconds), as :mod:`dtensor.analysis.floor` reads a compiled program:

- **compute**: the model FLOPs (the script's, else ``6 x params x tokens``) over the chips
  at the chip's bf16 peak, attention's share counted as its implementation's matmuls are
  (Splash's backward kernels, cuDNN's causal half), raised by the remat's recomputed forward
  pass (a third of the layers' matmuls; an offloading plan recomputes only the matmuls whose
  outputs it does not keep), by the logits recomputed when the loss is sliced by
  vocabulary (``--loss-chunks`` without ``--loss-tiling tokens``) and by the pipeline's
  bubble iterations
  (``(R M + S - 1) / (R M)``);
- **ICI / DCN**: each axis's collectives at their ring sizes: ``fsdp x context x expert``
  gathers the weights as XLA's plan does (three times a step, four with remat; once when
  kept) and reduce-scatters their float32 gradients;
  ``data`` all-reduces the gradients' shard; ``tensor`` all-reduces ``[tokens, hidden]``
  four times a layer (six with remat); ``context`` gathers keys and values (and
  reduce-scatters their gradients); ``expert`` sends each routed token four times (all-to-all;
  six with remat); ``stage`` passes each microbatch's activations on. An axis that spans
  slices puts its bytes on DCN (on NVIDIA GPUs: an axis that spans hosts, the share of its
  bytes that must leave each host, over its GPUs' NICs);
- **host link**: an offloading plan's tensors, each layer's sent to host memory and back,
  over the chip's host link (:mod:`dtensor.analysis.floor`).

It errs in both directions (XLA's scheduling, fusion and buffer reuse are not modelled): the
search compiles its best candidates and reports how far each estimate was from the compile.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dtensor.analysis.hardware import Chip
from dtensor.core.attention_xla import ulysses_repeats
from dtensor.core.schedules import INTERLEAVED_SCHEDULES, make_schedule
from dtensor.tpu.plans import AXES, ModelFacts, Plan, device_tokens, logits_bytes

__all__ = ["OFFLOADED", "Estimate", "estimate"]


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
    """The analytic model's figures for one plan, per device (see the module docs)."""

    state_bytes: float
    gathered_bytes: float
    activation_bytes: float
    working_bytes: float
    compute_seconds: float
    ici_seconds: float
    dcn_seconds: float | None
    axis_bytes: dict[str, float]
    networks: tuple[str, str] = ("ICI", "DCN")
    mfu_ceiling: float | None = None
    host_bytes: float = 0.0
    host_seconds: float = 0.0

    @property
    def peak_bytes_per_device(self) -> float:
        """State + gathered weights + kept activations + the larger working set."""
        return self.state_bytes + self.gathered_bytes + self.activation_bytes + self.working_bytes

    @property
    def step_time_floor_seconds(self) -> float:
        """The larger of compute, the two networks and the host link."""
        return max(
            self.compute_seconds, self.ici_seconds, self.dcn_seconds or 0.0, self.host_seconds
        )

    @property
    def bound(self) -> str:
        """``"compute"``, the network or ``"host link"``: what sets the floor."""
        terms = {"compute": self.compute_seconds, self.networks[0]: self.ici_seconds}
        terms[self.networks[1]] = self.dcn_seconds or 0.0
        terms["host link"] = self.host_seconds
        return max(terms, key=lambda k: terms[k])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the peak, the floor and its bound."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(
            peak_bytes_per_device=self.peak_bytes_per_device,
            step_time_floor_seconds=self.step_time_floor_seconds,
            bound=self.bound,
            networks=list(self.networks),
        )
        return d


#: The attention FLOPs the floor's reader counts, per the model's ``12 x layers x heads x
#: head_dim x seq x tokens``: XLA's einsums (``q k^T`` and ``p v``, forward and backward) as
#: the model; Splash's forward (2 matmuls) and backward kernels (3 for dq, 4 for dk/dv), every
#: grid step, masked blocks included; cuDNN's fused forward and backward (2 + 5), causal: half.
_ATTENTION_FLOPS = {"xla": 1.0, "splash": 1.5, "cudnn": 7 / 12}


def _attention(facts: ModelFacts, chip: Chip, plan: Plan) -> str:
    """The attention the step runs: the script's choice, ``"auto"`` resolved as
    ``dtensor.context_attention`` resolves it (Splash on TPU; cuDNN on NVIDIA GPUs in
    bfloat16 without a context axis; XLA's einsums else)."""
    if facts.attention != "auto":
        return facts.attention if facts.attention in _ATTENTION_FLOPS else "xla"
    if chip.networks == ("NVLink", "IB"):
        return "cudnn" if plan.precision != "none" and plan.context == 1 else "xla"
    return "splash"


def _ring(kind: str, nbytes: float, n: int) -> float:
    """A collective's bytes per device over ``n`` devices (:mod:`dtensor.analysis.collective`)."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * nbytes


def _spanning(plan: Plan, group: int) -> dict[str, int]:
    """Axis -> how many device groups (slices, hosts) of ``group`` devices its collectives
    span: the mesh's axes in order, the one ``across_slices`` names outermost."""
    order = [a for a in AXES if a != plan.across_slices]
    if plan.across_slices:
        order.insert(0, plan.across_slices)
    inner, out = 1, {}
    for axis in reversed(order):
        size = plan.sizes[axis]
        span = max(1, inner * size // max(group, 1)) if inner * size > group else 1
        out[axis] = min(span, size)
        inner *= size
    return out


def estimate(
    plan: Plan,
    facts: ModelFacts,
    chip: Chip,
    *,
    group: int | None = None,
) -> Estimate:
    """The analytic model's memory and floor for ``plan`` (see the module docs).

    Args:
        plan: the configuration.
        facts: the model.
        chip: the accelerator (:data:`dtensor.analysis.hardware.CHIPS`).
        group: devices within one slice (TPU) or host (GPU); default: all of them.

    Examples:
        >>> from dtensor.analysis.hardware import CHIPS
        >>> from dtensor.tpu.estimate import estimate
        >>> from dtensor.tpu.plans import ModelFacts, Plan
        >>> facts = ModelFacts(params=2 * 10**9, layers=16, heads=8, kv_heads=8, head_dim=128,
        ...                    hidden=1024, ffn=4096, vocab=32000, batch=16, seq=1024)
        >>> e = estimate(Plan(fsdp=16), facts, CHIPS["TPU v5 lite"])
        >>> round(e.state_bytes / 2**30, 2), e.bound
        (1.86, 'ICI')
    """
    n = plan.chips
    group = group or n
    cb = 2.0 if plan.precision != "none" else 4.0
    t, s, d_ = plan.tensor, plan.stage, plan.data
    g = plan.fsdp * plan.context * plan.expert  # the axes that split the weights as FSDP
    d, L = facts.hidden, facts.layers
    embed = facts.vocab * d * (1 if facts.tied else 2)
    experts = L * facts.experts * 3 * d * facts.ffn if facts.experts else 0
    stack = max(facts.params - embed, 0)  # the layers (experts included) and final norms

    # --- memory
    local = stack / (n / d_) + embed / (n / (d_ * s))  # each device's share of the parameters
    state = local * (4 + 4 + (0 if plan.offload else 8))
    layer = (stack - experts) / L / t + experts / L / (plan.expert * t)
    gathered = 0.0
    if g > 1:  # a layer read and the next prefetched (every layer when kept), the embeddings
        kept = 2 if plan.reshard else L // s
        gathered = layer * (kept * cb + 4) + embed / t * cb
    tokens = device_tokens(plan, facts)
    hq, hkv = facts.heads * facts.head_dim / t, facts.kv_heads * facts.head_dim / t
    f = facts.ffn * (facts.experts_per_token if facts.experts else 1) / t
    kind = _attention(facts, chip, plan)
    scores = facts.heads / t * facts.seq if kind == "xla" else 0.0
    everything = cb * (2 * d + 2 * hq + 2 * hkv + 2 * f) + 8 * d + scores * (4 + cb)
    # HybridStrategy keeps each remat'd block's input split along the sequence over
    # ``tensor`` (Megatron's sequence parallelism; llama3.1-405b fsdp=128 tensor=4: 15.8 GiB
    # of kept inputs whole, 3.9 split, compiled 22.9 GiB a chip against 37.2 estimated)
    sp = t if plan.preset == "hybrid" and plan.remat != "none" else 1
    saved = {
        "none": everything,
        "full": cb * d / sp,
        "dots_saveable": cb * (d / sp + d + hq + 2 * hkv + 2 * f) + scores * cb,
    }.get(plan.remat, cb * (d / sp + d + hq + 2 * hkv + 2 * f))
    # A per-tensor plan that offloads (strategies.reads.remat_plan): the named tensors of each
    # layer go to host memory and back, the block input stays (unless it is the one offloaded).
    offloaded = _offloaded(plan.remat, d / sp, hq, hkv, f, d / sp)
    if offloaded is not None:
        elements, kept_input = offloaded
        saved = cb * d / sp * kept_input
    host = tokens * (L / s) * cb * (offloaded[0] if offloaded else 0.0)
    activations = tokens * (L / s) * saved
    table = _interleaved(plan, L)
    if table is not None:  # what a stage keeps of the microbatches in flight: layer inputs
        # under remat, the layers' residuals without (dtensor.core.interleaved, keep=)
        held = max(table.in_flight) / (table.microbatches * table.rounds)
        kept = cb * d / sp if plan.remat != "none" else everything
        activations = tokens * held * (L / s) * kept
    # Ulysses (context_mode="ulysses"): each device the whole sequence of its heads / C heads,
    # q, k, v and the output exchanged by all-to-alls (KV heads repeated to divide over C);
    # gather and ring: the whole sequence's K/V of every local head.
    ulysses = plan.context > 1 and plan.context_mode == "ulysses"
    local_kv = facts.kv_heads // t if facts.kv_heads % t == 0 else facts.kv_heads
    repeats = ulysses_repeats(local_kv, plan.context) if ulysses else 1
    exchanged = tokens * (2 * hq + 2 * hkv * repeats) * cb  # q, out, k, v (Ulysses)
    gathered_kv = tokens * plan.context * 2 * hkv * cb  # the whole sequence's K and V
    kv = exchanged if ulysses else gathered_kv if plan.context > 1 else 0.0
    working = tokens * (everything if plan.remat != "none" else 0.0) + kv
    logits = logits_bytes(plan, facts, cb)
    working = max(working, logits)

    # --- floor
    gpu = chip.networks == ("NVLink", "IB")
    tokens_all = facts.batch * facts.seq
    mf = facts.model_flops or 6.0 * facts.params * tokens_all
    att = min(12.0 * L * facts.heads * facts.head_dim * facts.seq * tokens_all, mf)
    head = min(6.0 * facts.vocab * d * tokens_all, mf - att)
    # the recomputed forward pass: a third of the layers' matmuls (XLA's attention's too)
    # A block's last matmul (the MLP's down projection) is not recomputed: the backward pass
    # needs its input, not its output (llama2-70b fsdp=32 tensor=2 on v5p:4x4x4: compiled
    # 1165 ms against 1249 estimated when every matmul was), nor, under an offloading plan,
    # those whose outputs it keeps.
    full_again = 1 / 3 * (1 - _kept_matmuls("full", d, hq, hkv, f))
    again = full_again if plan.remat == "full" else 0.0
    if offloaded is not None:
        again = 1 / 3 * (1 - _kept_matmuls(plan.remat, d, hq, hkv, f))
    att_again = 1 / 3 if plan.remat == "full" or offloaded is not None else 0.0
    if table is not None:  # under remat the backward ticks recompute their layers; zero-
        # bubble's weight-gradient ticks run the layers' backward chain again besides
        again = (full_again if plan.remat != "none" else 0.0) + (
            1 / 3 if table.name == "zero-bubble" else 0.0
        )
    flops = (mf - att - head) * (1 + again) + head
    if plan.loss_chunks > 1 and plan.loss_tiling == "vocab":
        flops += head / 3  # the logits recomputed in the backward pass
    flops += att * (_ATTENTION_FLOPS[kind] + (att_again if kind == "xla" else 0.0))
    rounds = max(1, L // s) if plan.schedule == "circular" else 1
    if table is not None:
        flops /= 1 - table.bubble_fraction
    elif s > 1:
        m = plan.microbatches * rounds
        flops *= (m + s - 1) / m
    compute = flops / n / chip.peak_flops
    rematted = plan.remat == "full" or offloaded is not None  # weights read again, recomputing
    passes = 6 if rematted else 4  # forward, backward (and recomputed forward)
    weights = (stack - experts) / (t * s) + experts / (plan.expert * t * s) + embed / t
    by_axis = {a: 0.0 for a in AXES}
    # XLA's plan (gather_at_read=False, the TPU and GPU default) gathers a weight about
    # three times a step, four with remat (Gemma 2B on v5e:4x4: 4.5); libtpu's
    # reduce-scatter is a ring of collective permutes that the HLO reader counts twice.
    gathers = (4 if rematted else 3) if plan.reshard else 1
    fsdp_bytes = _ring("all-gather", weights * cb, g) * gathers
    fsdp_bytes += _ring("reduce-scatter", weights * 4, g) * (1 if gpu else 2)
    for axis in ("fsdp", "context", "expert"):  # one group: share it by the axes' sizes
        by_axis[axis] += (
            fsdp_bytes
            * (plan.sizes[axis] > 1)
            / max(sum(plan.sizes[a] > 1 for a in ("fsdp", "context", "expert")), 1)
        )
    by_axis["data"] = _ring("all-reduce", weights / g * 4, d_)
    act = tokens * d * cb
    by_axis["tensor"] = _ring("all-reduce", act, t) * (passes * L / s + 2)
    if ulysses:
        kv_bytes = _ring("all-to-all", exchanged, plan.context)
    else:
        kv_bytes = _ring("all-gather", gathered_kv, plan.context)
    by_axis["context"] += kv_bytes * (3 if rematted else 2) * L / s
    if facts.experts:
        sent = tokens * facts.experts_per_token * d * cb
        by_axis["expert"] += _ring("all-to-all", sent, plan.expert) * passes * L / s
    if table is not None:  # a microbatch's activations on, or gradients back, a tick each
        moves = sum(f + b for f, b, _, _ in map(table.kinds, range(table.ticks)))
        by_axis["stage"] = moves * act / plan.microbatches
    elif s > 1:
        m = plan.microbatches * rounds
        by_axis["stage"] = 2 * (m + s - 1) * act / plan.microbatches
    spans = _spanning(plan, group)
    within = between = 0.0
    for axis, nbytes in by_axis.items():
        h, size = spans[axis], plan.sizes[axis]
        if h <= 1:
            within += nbytes
        elif gpu:  # what must leave each host, over its GPUs' NICs (dtensor.analysis.floor)
            between += nbytes * ((h - 1) / h) / ((size - 1) / size) / (size / h)
        else:
            between += nbytes
    dcn = None if chip.dcn_bytes_per_s is None else between / chip.dcn_bytes_per_s
    if dcn is None and between:
        within += between  # no published DCN figure: charge it to the network within
    host_seconds = host / chip.host_bytes_per_s if host and chip.host_bytes_per_s else 0.0
    floor = max(compute, within / chip.ici_bytes_per_s, dcn or 0.0, host_seconds)
    return Estimate(
        state_bytes=state,
        gathered_bytes=gathered,
        activation_bytes=activations,
        working_bytes=working,
        compute_seconds=compute,
        ici_seconds=within / chip.ici_bytes_per_s,
        dcn_seconds=dcn,
        axis_bytes=by_axis,
        networks=chip.networks,
        mfu_ceiling=mf / (n * chip.peak_flops * floor) if floor > 0 else None,
        host_bytes=host,
        host_seconds=host_seconds,
    )


#: The offloading remat plans the search prices (MaxText's names; the decoder's tensors):
#: what each layer sends to host memory.
OFFLOADED = {
    "qkv_proj_offloaded": ("query_proj", "key_proj", "value_proj"),
    "minimal_offloaded": (
        "query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo",
    ),
    "layer_input_offloaded": ("decoder_layer_input",),
}  # fmt: skip


def _offloaded(
    remat: str, block_input: float, hq: float, hkv: float, f: float, d: float
) -> tuple[float, float] | None:
    """``(elements a token sends to host a layer, 1 if the block input stays on device else
    0)`` for an offloading plan; ``None`` for any other. ``d`` is the width of the attention's
    and the MLP's outputs as kept (split along the sequence under sequence parallelism)."""
    names = OFFLOADED.get(remat)
    if names is None:
        return None
    size = {
        "decoder_layer_input": block_input,
        "query_proj": hq,
        "key_proj": hkv,
        "value_proj": hkv,
        "out_proj": d,
        "mlpwi_0": f,
        "mlpwi_1": f,
        "mlpwo": d,
    }
    return sum(size[n] for n in names), float("decoder_layer_input" not in names)


def _kept_matmuls(remat: str, d: float, hq: float, hkv: float, f: float) -> float:
    """The share of a layer's matmul FLOPs the backward pass does not recompute under
    ``remat``: those whose outputs an offloading plan keeps (on host), and the MLP's down
    projection, whose output the backward pass never needs."""
    flops = {
        "query_proj": d * hq,
        "key_proj": d * hkv,
        "value_proj": d * hkv,
        "out_proj": hq * d,
        "mlpwi_0": d * f,
        "mlpwi_1": d * f,
        "mlpwo": f * d,
    }
    total = sum(flops.values())
    kept = {*OFFLOADED.get(remat, ()), "mlpwo"}
    return sum(flops[n] for n in kept if n in flops) / total if total else 0.0


def _interleaved(plan: Plan, layers: int) -> Any:
    """The tick table of a plan's interleaved schedule (1F1B and kin), or ``None``."""
    if plan.stage <= 1 or plan.schedule not in INTERLEAVED_SCHEDULES:
        return None
    rounds = max(1, layers // plan.stage) if plan.schedule == "interleaved-1f1b" else 1
    return make_schedule(plan.schedule, plan.stage, plan.microbatches, rounds)
