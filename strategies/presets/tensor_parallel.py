"""`TensorParallelStrategy` (Megatron column/row rules) and `HybridStrategy` (data x fsdp x tensor)."""

from __future__ import annotations

import contextlib
import math
import re
import sys
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import flax.nnx as nnx
import jax
import numpy as np

import dtensor
from dtensor import Layout, LayoutMap
from dtensor.core.attention import MODES as CONTEXT_MODES
from dtensor.core.attention import context_mode as _context_mode
from dtensor.core.tree import leaf_value, path_str
from strategies.base import Strategy
from strategies.placement.sharding import nbytes, shard_largest_dim
from strategies.placement.slices import slice_mesh
from strategies.reads.attention import route_attention_fns, routed_flax_attention
from strategies.reads.mixed_precision import MixedPrecision
from strategies.reads.param_reads import ReadOptions
from strategies.reads.pipeline import (
    PipelineError,
    PipelinePlan,
    find_stacks,
    pipelined,
    prepare_lists,
)
from strategies.reads.swaps import check_remat
from strategies.reads.swaps import remat_policy as remat_policy_fn

__all__ = ["HybridStrategy", "TensorParallelStrategy", "megatron_specs"]

_T = "tensor"
# Module names (the path component before the parameter name) by role.
_COLUMN = re.compile(
    r"^(up|gate|wi|wi_\d|fc1|fc_in|w1|w3|in_proj|linear1|dense1|dense_in|hidden|mlp_in|intermediate|c_fc|qkv|head|lm_head)$"
)
_ROW = re.compile(
    r"^(down|wo|fc2|fc_out|w2|out_proj|linear2|dense2|dense_out|mlp_out|output|c_proj|proj)$"
)
_ATTN_IN = re.compile(r"^(query|key|value|q_proj|k_proj|v_proj|q|k|v)$")
_ATTN_OUT = re.compile(r"^(out|o_proj|o)$")
_EMBED = re.compile(r"^(embedding|embed|wte|tok_embeddings|token_embedding)$")
_E = "expert"
_C = "context"
_S = "stage"
SCHEDULES = ("gpipe", "circular")


def expert_dim(path: str, shape: Sequence[int]) -> int | None:
    """The experts dimension of a stacked expert weight, by its path, or ``None``.

    The rule: a variable of rank 3 or more with a path component ``experts``
    (the module holding the stacked weights, as ``moe/experts/up``, or the
    parameter's own name, as ``moe/experts``) is ``[..., experts, in, out]``:
    its experts dimension is the third from last (a scanned stack's leading
    layer dimension comes before it).

    Examples:
        >>> from strategies.presets.tensor_parallel import expert_dim
        >>> expert_dim("blocks/0/moe/experts/up", (8, 64, 128)), expert_dim("layers/moe/experts/up", (2, 8, 64, 128))
        (0, 1)
        >>> expert_dim("blocks/0/mlp/up", (64, 128)) is None
        True
    """
    if len(shape) < 3 or "experts" not in path.split("/"):
        return None
    return len(shape) - 3


def megatron_specs(path: str, shape: Sequence[int]) -> tuple[list[Any], str] | None:
    """Megatron-LM's layout for a Flax parameter, by its module and parameter names.

    Column-parallel layers (MLP up/gate, attention query/key/value) split
    their output features; row-parallel layers (MLP down, attention out) split
    their input features; embeddings split the vocabulary. Returns the specs
    and the rule's name, or ``None`` when no rule applies.

    Examples:
        >>> from strategies.presets.tensor_parallel import megatron_specs
        >>> megatron_specs("blocks/0/mlp/up/kernel", (64, 256))
        (['unsharded', 'tensor'], 'column')
        >>> megatron_specs("blocks/0/attn/out/kernel", (4, 16, 64))
        (['tensor', 'unsharded', 'unsharded'], 'row (attention out)')
    """
    parts = path.split("/")
    if len(parts) < 2:
        return None
    module, param = parts[-2], parts[-1]
    u = dtensor.UNSHARDED
    rank = len(shape)
    if param == "embedding" and rank == 2:
        return [_T, u], "vocab"
    if _EMBED.match(module) and rank == 2:
        return [_T, u], "vocab"
    if _ATTN_IN.match(module):
        if param == "kernel" and rank == 3:
            return [u, _T, u], "column (attention heads)"
        if param == "bias" and rank == 2:
            return [_T, u], "column (attention heads)"
        if param == "kernel" and rank == 2:
            return [u, _T], "column"
        if param == "bias" and rank == 1:
            return [_T], "column"
    if _ATTN_OUT.match(module):
        if param == "kernel" and rank == 3:
            return [_T, u, u], "row (attention out)"
        if param == "kernel" and rank == 2:
            return [_T, u], "row"
        if param == "bias":
            return [u] * rank, "row (bias replicated)"
    if _COLUMN.match(module):
        if param == "kernel" and rank == 2:
            return [u, _T], "column"
        if param == "bias" and rank == 1:
            return [_T], "column"
    if _ROW.match(module):
        if param == "kernel" and rank == 2:
            return [_T, u], "row"
        if param == "bias":
            return [u] * rank, "row (bias replicated)"
    if rank <= 1:
        return [u] * rank, "replicated (norms, scalars)"
    return None


class HybridStrategy(Strategy):
    """A ``("data", "fsdp", "tensor")`` mesh: Megatron rules on ``tensor``, then
    FSDP on the largest remaining dimension over ``fsdp``; the batch split over
    ``data`` and ``fsdp``. With ``context=C`` and ``expert=E``, a ``("data",
    "fsdp", "context", "expert", "tensor")`` mesh for long sequences and
    mixtures of experts.

    Args:
        data: data-parallel size (``-1``: whatever the devices leave).
        fsdp: fully-sharded size.
        tensor: tensor-parallel size.
        expert: expert-parallel size. Stacked expert weights (the rule of
            :func:`expert_dim`: rank 3 or more under a path component
            ``experts``, ``[..., experts, in, out]``) split their experts
            dimension over ``expert`` (and FSDP's largest other dimension over
            ``fsdp``); every other variable is FSDP-split over ``fsdp`` and
            ``expert`` together, as MaxText shards them; the batch is split
            over ``data``, ``fsdp`` and ``expert``. An MoE layer dispatches
            its tokens by calling :func:`dtensor.expert_mlp` (all-to-alls over
            ``expert``); the rest of the model is data parallel over it. It
            needs ``gather_at_read`` off (``None`` then means ``False``).
        context: context-parallel size (long sequences). A ``context`` mesh
            axis (between ``fsdp`` and ``expert``): every batch array of rank 2
            or more has its dimension 1 (the sequence) split over it, and the
            layers' inputs and outputs stay so split through the step; variables
            are FSDP-split over ``fsdp`` and ``context`` together (MaxText's
            plan). Attention runs per device by :func:`dtensor.context_attention`
            (a hand-written attention calls it; Flax's
            ``nnx.dot_product_attention`` and ``nnx.MultiHeadAttention``'s
            default are routed to it inside the step, the model unchanged); the
            rest of the model is data parallel over ``context``. It needs
            ``gather_at_read`` off (``None`` then means ``False``).
        context_mode: ``"gather"`` (keys and values all-gathered over
            ``context``, MaxText's default) or ``"ring"`` (passed round a ring of
            collective permutes, causal attention load-balanced); see
            :mod:`dtensor.core.attention`.
        stage: pipeline-parallel size. A ``stage`` mesh axis (after ``data``):
            the blocks of the classes named in ``pipeline=`` — a scanned stack
            (one module of stacked layers run by ``nnx.scan``) or a list of
            identical blocks — run in stages (:mod:`strategies.reads.pipeline`,
            :func:`dtensor.core.pipeline.pipeline`): each stage's devices hold
            its layers, the batch goes through in ``microbatches``, the
            activations passed on by collective permutes over ``stage``. A
            stack's variables are split along their layer dimension over
            ``stage`` (FSDP and Megatron rules on the other dimensions); a
            list's blocks are FSDP-split over ``stage`` and ``fsdp`` together
            and re-stacked by stage in each step (an all-to-all over
            ``stage``). Everything else (embeddings, final norm, head) is
            replicated over ``stage`` and computed on every stage. Scalars
            the blocks add to (an MoE block's load-balancing loss) are
            accumulated per microbatch and averaged. It composes with every
            other axis (``data``, ``fsdp``, ``tensor``, ``context``,
            ``expert`` inside each stage). It needs ``gather_at_read`` off
            (``None`` then means ``False``).
        microbatches: how many microbatches a step's batch is cut into (default:
            ``stage``); each must still split over the batch axes.
        schedule: ``"gpipe"`` (each stage ``L / S`` consecutive layers, every
            microbatch's forward then every backward) or ``"circular"`` (each
            stage ``repeats`` groups of layers ``S`` groups apart, the ring
            gone round ``repeats`` times: the bubble ``(S - 1) / (R M + S - 1)``
            instead of ``(S - 1) / (M + S - 1)``; needs ``microbatches >= stage``).
        repeats: the circular schedule's rounds (default: one layer per stage
            per round, ``L / S``, MaxText's default).
        pipeline: the block classes to pipeline (as for ``remat=``).
        rules: a :class:`dtensor.LayoutMap` (on this strategy's mesh, or
            given as ``(regex, specs)`` pairs) tried before the Megatron rules.
        min_shard_bytes: variables smaller than this are not FSDP-sharded.
        devices: the devices.
        reshard_after_forward, mixed_precision, remat, remat_policy: as for
            :class:`strategies.FullyShardedStrategy`, for the ``fsdp`` axis.
        gather_at_read: as for :class:`strategies.FullyShardedStrategy`, over
            ``fsdp``: ``True`` gathers each ``fsdp``-split variable where it is
            read in a step on Flax NNX modules (an all-gather over ``fsdp``),
            its gradient reduce-scattered over ``fsdp`` and then all-reduced
            over ``data`` at shard size; the batch stays split over ``data``
            and ``fsdp``. ``False`` leaves the plan to XLA's SPMD partitioner
            (which decides by itself what to keep: ``reshard_after_forward``
            then changes nothing, as under FullyShardedStrategy). ``None`` (the default) chooses
            by platform: ``True`` on CPU, whose compiler never forms a
            reduce-scatter by itself (it all-reduces full-size gradients),
            ``False`` on TPU and GPU, whose compilers form reduce-scatters and
            plan memory better by themselves. It needs ``tensor=1`` (``None``
            means ``False`` otherwise; ``True`` raises): the step is traced
            with every mesh axis Explicit, where a row-parallel Megatron
            matmul's contraction over ``tensor`` has no defined output layout.
            It does nothing when ``fsdp=1``.
        across_slices: on a multi-slice TPU topology (devices with distinct
            ``slice_index``), the axis that spans the slices over DCN; the
            others stay within each slice (``data``, ``fsdp`` and ``tensor``
            remain the sizes of the whole mesh). ``"data"``: each slice holds
            whole replicas (fsdp and tensor within it; only the gradient
            all-reduces over ``data`` cross DCN, as MaxText's default);
            ``data`` must be a multiple of the slice count, and ``data=-1``
            resolves to ``slices x`` what is left within a slice. ``"fsdp"``:
            each fsdp group spans the slices (its all-gathers and
            reduce-scatters cross DCN in every layer); ``fsdp`` must be a
            multiple of the slice count. ``None`` (the default): ``"data"``
            when ``data`` is a multiple of the slice count (each replica's
            ``fsdp x tensor`` devices fit within a slice), else ``"fsdp"``.
            Measured on the TPU compiler (``docs/guides/large_models.md``,
            "Across slices"): ``"data"`` sends less over DCN and has the
            lower step-time floor, at the memory of a replica over one
            slice's chips. On one slice, CPU and GPU devices the mesh is
            unchanged and the option only has its name checked. ``"stage"``
            (with ``stage=S``, a multiple of the slice count): each slice
            holds whole pipeline stages, only the activations' permutes (and
            the small gradient all-reduces of what the stages replicate)
            cross DCN.
            ``strategy.across_slices`` is the axis that spans slices
            (``None`` on one slice).

    Examples:
        >>> import strategies
        >>> s = strategies.HybridStrategy(data=2, fsdp=2, tensor=2)
        >>> s.mesh, s.num_replicas_in_sync
        (Mesh(data=2, fsdp=2, tensor=2), 4)
        >>> import jax.numpy as jnp
        >>> s.variable_layout("mlp/up/kernel", jnp.zeros((64, 256)))
        Layout(['fsdp', 'tensor'], mesh=Mesh(data=2, fsdp=2, tensor=2))
        >>> import dtensor  # two slices of 4 TPU chips (libtpu's devices, no TPU needed)
        >>> two = dtensor.tpu_topology("v5e:2x2", num_slices=2)
        >>> s = strategies.HybridStrategy(fsdp=4, devices=two, across_slices="data")
        >>> s.mesh, s.across_slices
        (Mesh(data=2, fsdp=4, tensor=1), 'data')
    """

    name = "hybrid"
    shards_variables = True

    def __init__(
        self,
        data: int = -1,
        fsdp: int = 1,
        tensor: int = 1,
        *,
        rules: LayoutMap | Sequence[tuple[str, Sequence[Any]]] | None = None,
        min_shard_bytes: int = 16 << 10,
        devices: Sequence[Any] | None = None,
        reshard_after_forward: bool = True,
        mixed_precision: MixedPrecision | None = None,
        remat: Sequence[type] | None = None,
        remat_policy: Any = None,
        gather_at_read: bool | None = None,
        across_slices: str | None = None,
        expert: int = 1,
        context: int = 1,
        context_mode: str = "gather",
        stage: int = 1,
        microbatches: int | None = None,
        schedule: str = "gpipe",
        repeats: int | None = None,
        pipeline: Sequence[type] | None = None,
    ) -> None:
        devices = list(devices) if devices is not None else jax.devices()
        for name, size in (("expert", expert), ("context", context), ("stage", stage)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"HybridStrategy({name}={size!r}): the {name}-parallel size must be a "
                    f"positive integer (1: no {name} axis)."
                )
        if context_mode not in CONTEXT_MODES:
            raise ValueError(
                f"HybridStrategy(context_mode={context_mode!r}): valid modes are "
                f"{CONTEXT_MODES} ('gather': keys and values all-gathered over 'context'; "
                "'ring': passed round a ring of collective permutes)."
            )
        self._check_pipeline(stage, microbatches, schedule, repeats, pipeline)
        dims = [("data", data), ("fsdp", fsdp), ("tensor", tensor)]
        if stage > 1:
            dims.insert(1, (_S, stage))
        if context > 1:  # an axis of size 1 is left out of the mesh
            dims.insert(2, (_C, context))
        if expert > 1:
            dims.insert(len(dims) - 1, (_E, expert))
        mesh, self.across_slices = slice_mesh(dims, devices, across_slices)
        self.expert = expert
        self.context = context
        self.context_mode = context_mode
        if gather_at_read and context > 1:
            raise ValueError(
                f"HybridStrategy(gather_at_read=True) needs context=1 (got context={context}): "
                "gathering at reads traces the step with every mesh axis Explicit, where the "
                "sequence split over 'context' has no defined layout through the model's "
                "reshapes. Pass gather_at_read=False (or None) to leave the fsdp gathers to XLA."
            )
        if gather_at_read and stage > 1:
            raise ValueError(
                f"HybridStrategy(gather_at_read=True) needs stage=1 (got stage={stage}): "
                "gathering at reads traces the step with every mesh axis Explicit, where the "
                "stages' vmapped loop has no defined layout. Pass gather_at_read=False (or "
                "None) to leave the fsdp gathers to XLA."
            )
        if gather_at_read and expert > 1:
            raise ValueError(
                f"HybridStrategy(gather_at_read=True) needs expert=1 (got expert={expert}): "
                "gathering at reads would gather the stacked expert weights over every batch "
                "axis, expert included, before dtensor.expert_mlp splits them again. Pass "
                "gather_at_read=False (or None) to leave the fsdp gathers to XLA."
            )
        if gather_at_read is None:  # by the compiler of the platform the step runs on
            gather_at_read = (
                devices[0].platform == "cpu"
                and mesh.shape["tensor"] == 1
                and expert == 1
                and context == 1
                and stage == 1
            )
        elif gather_at_read and mesh.shape["tensor"] > 1:
            raise ValueError(
                f"HybridStrategy(gather_at_read=True) needs tensor=1 (got tensor="
                f"{mesh.shape['tensor']}): gathering at reads traces the step with every mesh "
                "axis Explicit, where a row-parallel (Megatron) matmul's sharded contraction "
                "has no defined output layout. Pass tensor=1, or gather_at_read=False (or None) "
                "to leave the fsdp gathers to XLA."
            )
        self.gather_at_read = bool(gather_at_read)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.remat = check_remat(remat)
        self.remat_policy = remat_policy
        self._policy = remat_policy_fn(remat_policy)
        batch = ("data", "fsdp", _E) if expert > 1 else ("data", "fsdp")
        super().__init__(mesh, batch_axes=batch, mixed_precision=mixed_precision)
        if rules is not None and not isinstance(rules, LayoutMap):
            rules = LayoutMap(mesh, rules)
        if isinstance(rules, LayoutMap) and rules.mesh != mesh:
            rules = LayoutMap(
                mesh,
                rules.rules,
                logical_axis_rules=rules.logical_axis_rules,
            )
        self.rules = rules
        self.min_shard_bytes = min_shard_bytes

    def _check_pipeline(
        self,
        stage: int,
        microbatches: int | None,
        schedule: str,
        repeats: int | None,
        pipeline: Sequence[type] | None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(
                f"HybridStrategy(schedule={schedule!r}): valid schedules are {SCHEDULES} "
                "('gpipe': each stage its consecutive layers; 'circular': each stage several "
                "layer groups, the ring gone round several times)."
            )
        if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
            raise ValueError(
                f"HybridStrategy(microbatches={microbatches!r}): the microbatch count must be "
                "a positive integer (default: the stage count)."
            )
        if repeats is not None and (not isinstance(repeats, int) or repeats < 1):
            raise ValueError(
                f"HybridStrategy(repeats={repeats!r}): the circular schedule's rounds must be "
                "a positive integer (default: one layer per stage per round)."
            )
        if repeats is not None and repeats > 1 and schedule != "circular":
            raise ValueError(
                f"HybridStrategy(repeats={repeats}) goes with schedule='circular' (GPipe goes "
                "round once); pass schedule='circular' or drop repeats."
            )
        classes = check_remat(pipeline)
        if stage > 1 and not classes:
            raise ValueError(
                f"HybridStrategy(stage={stage}) needs pipeline=(Block,): the module class of "
                "the blocks the model repeats (a scanned stack or a list of identical blocks), "
                "which the stages split between them."
            )
        if stage == 1 and (classes or microbatches not in (None, 1)):
            raise ValueError(
                "HybridStrategy(pipeline=..., microbatches=...) pipelines over a stage axis: "
                f"pass stage=S > 1 with them (got stage={stage})."
            )
        m = stage if microbatches is None else microbatches
        if schedule == "circular" and stage > 1 and m < stage:
            raise ValueError(
                f"HybridStrategy(schedule='circular', stage={stage}, microbatches={m}): the "
                "circular schedule needs at least as many microbatches as stages (a "
                "microbatch comes back to stage 0 for its next round only after stage 0 has "
                f"started every one of this round). Pass microbatches >= {stage}, or "
                "schedule='gpipe'."
            )
        self.stage = stage
        self.microbatches = m if stage > 1 else 1
        self.schedule = schedule
        self.repeats = repeats
        self.pipeline = classes
        self._stacks: dict[tuple[str, ...], str] = {}

    @property
    def bubble_fraction(self) -> float:
        """The idle fraction of a step by the schedule (0 without ``stage``); for the
        circular schedule with ``repeats=None`` the rounds are known once a model is seen."""
        from dtensor.core.pipeline import bubble_fraction

        return bubble_fraction(self.stage, self.microbatches, self._rounds() or 1)

    def pipeline_description(self) -> str:
        """The schedule in words (``""`` without ``stage``), as ``explain`` reports it."""
        if self.stage == 1:
            return ""
        r = self._rounds() or 1
        text = f"{self.schedule}, {self.stage} stages x {self.microbatches} microbatches"
        return text + (f", {r} rounds" if self.schedule == "circular" else "")

    def _rounds(self, layers: int | None = None) -> int | None:
        if self.schedule == "gpipe":
            return 1
        if self.repeats is not None:
            return self.repeats
        layers = layers or getattr(self, "_layers", None)
        return None if not layers else max(1, layers // self.stage)

    def observe(self, node: Any) -> None:
        """With ``stage``: learn where ``node`` holds the ``pipeline=`` blocks (their paths),
        which the layout rules split over ``stage`` (once per object)."""
        if self.stage == 1:
            return
        seen = self.__dict__.setdefault("_seen", weakref.WeakSet())
        try:
            if node in seen:
                return
            seen.add(node)
        except TypeError:  # not weakly referenceable: look every time
            pass
        found = find_stacks(node, self.pipeline)
        for path, kind in found.items():
            key = tuple(str(p) for p in path)
            self._stacks[key[:-1] + ("*",) if kind == "list" else key] = kind
            if kind == "list":
                self._layers = sum(1 for p in found if p[:-1] == path[:-1])
        for path, kind in found.items():
            if kind == "stack":
                stack = _node_at(node, path)
                leads = [
                    np.shape(v.get_raw_value())[0]
                    for _, v in nnx.iter_graph(stack)
                    if isinstance(v, nnx.Variable)
                ]
                self._layers = int(leads[0])

    def _stack_kind(self, path: str) -> str | None:
        """``"stack"`` or ``"list"`` where ``path`` (a variable's, or an optimizer moment's
        ending in it) lies inside the ``pipeline=`` blocks, else ``None``."""
        parts = tuple(path.split("/"))
        for key, kind in self._stacks.items():
            n = len(key)
            for i in range(len(parts) - n):
                window = parts[i : i + n]
                if all(k == "*" or k == w for k, w in zip(key, window, strict=True)):
                    if kind == "list" and not window[-1].isdigit():
                        continue
                    return kind
        return None

    def _tensor_specs(self, path: str, leaf: Any) -> tuple[list[Any], str | None]:
        shape = np.shape(leaf_value(leaf))
        if self.rules is not None:
            found = self.rules.match(path)
            if found is not None:
                return list(self.rules.layout_for(path, leaf).layout.sharding_specs), found[0]
        dim = expert_dim(path, shape) if self.expert > 1 else None
        if dim is not None:
            specs = [dtensor.UNSHARDED] * len(shape)
            if shape[dim] % self.expert:
                self._warn_once(
                    path,
                    shape,
                    f"{type(self).__name__}: variable {path} (shape {tuple(shape)}) is a stack "
                    f"of {shape[dim]} experts (dimension {dim}), which does not divide over the "
                    f"{_E!r} axis of size {self.expert}; its experts are replicated instead "
                    f"(dtensor.expert_mlp will refuse them). Choose expert= dividing "
                    f"{shape[dim]}.",
                )
                return specs, "expert (not divisible: replicated)"
            specs[dim] = _E
            return specs, "expert"
        if self.mesh.shape["tensor"] > 1:
            hit = megatron_specs(path, shape)
            if hit is not None:
                specs, rule = hit
                if self._indivisible(path, shape, specs, rule) is None:
                    return specs, f"megatron {rule}"
                return [dtensor.UNSHARDED] * len(
                    shape
                ), f"megatron {rule} (not divisible: replicated)"
        return [dtensor.UNSHARDED] * len(shape), None

    def _indivisible(
        self, path: str, shape: Sequence[int], specs: Sequence[Any], rule: str
    ) -> str | None:
        """Why a Megatron rule cannot split ``path`` (warned once per variable), or ``None``."""
        n = self.mesh.shape[_T]
        bad = [d for d, s in enumerate(specs) if s == _T and shape[d] % n]
        if not bad:
            return None
        d = bad[0]
        msg = (
            f"{type(self).__name__}: variable {path} (shape {tuple(shape)}) matches the Megatron "
            f"{rule} rule, which splits dimension {d} (size {shape[d]}) over the {_T!r} axis of "
            f"size {n} (the tensor-parallel size), but {shape[d]} is not divisible by {n}; the "
            f"variable is replicated on every device instead. Make dimension {d} a multiple of "
            f"{n}, choose a tensor-parallel size that divides {shape[d]}, or give the variable "
            "its own layout with rules=[(regex, specs)]."
        )
        self._warn_once(path, shape, msg)
        return msg

    def _warn_once(self, path: str, shape: Sequence[int], msg: str) -> None:
        warned = self.__dict__.setdefault("_indivisible_warned", set())
        # Once per variable; an optimizer's moments of it say nothing new.
        if "opt_state" not in path.split("/") and (path, tuple(shape)) not in warned:
            warned.add((path, tuple(shape)))
            warnings.warn(msg, UserWarning, stacklevel=_user_stacklevel())

    def layout_findings(self, path: str, leaf: Any) -> list[tuple[str, str]]:
        """A ``silent-replication`` finding for a variable a Megatron rule could not split."""
        shape = np.shape(leaf_value(leaf))
        if self.mesh.shape[_T] == 1 or "opt_state" in path.split("/"):
            return []
        if self.rules is not None and self.rules.match(path):
            return []
        hit = megatron_specs(path, shape)
        if hit is None:
            return []
        msg = self._indivisible(path, shape, *hit)
        return [] if msg is None else [("silent-replication", msg)]

    def variable_layout(self, path: str, leaf: Any) -> Layout:
        specs, _ = self._tensor_specs(path, leaf)
        specs = [None if s == dtensor.UNSHARDED else s for s in specs]
        shape = np.shape(leaf_value(leaf))
        # FSDP over fsdp and context together (MaxText's plan: the sequence-split devices
        # share the weights' storage too); dense variables over expert as well, so each of
        # those devices keeps 1/(fsdp x context x expert) of them.
        axes = [a for a in ("fsdp", _C) if self.mesh.shape.get(a, 1) > 1]
        if self.expert > 1 and _E not in specs and expert_dim(path, shape) is None:
            axes.append(_E)
        kind = self._stack_kind(path) if self.stage > 1 else None
        if kind == "stack" and shape and specs[0] is None and shape[0] % self.stage == 0:
            specs[0] = _S  # the layer dimension: each stage holds its layers
        elif kind == "list":
            axes.insert(0, _S)  # each block split over every stage, re-stacked in the step
        n = math.prod(self.mesh.shape[a] for a in axes)
        if axes and nbytes(leaf) >= self.min_shard_bytes and not set(axes) & set(specs):
            entry = axes[0] if len(axes) == 1 else tuple(axes)
            specs = shard_largest_dim(specs, shape, entry, n)
        return Layout(specs, self.mesh)

    def batch_layout(self, rank: int) -> Layout:
        """Dimension 0 over the batch axes; with ``context``, dimension 1 (the sequence) over it."""
        layout = super().batch_layout(rank)
        if self.context == 1 or rank < 2:
            return layout
        specs = [None if s == dtensor.UNSHARDED else s for s in layout.sharding_specs]
        specs[1] = _C
        return Layout(specs, self.mesh)

    def trace_step(self, call: Any, state: Any, arrays: Any, layouts: Any, shardings: Any) -> Any:
        """With ``context``: the step traced with :func:`dtensor.context_attention` in this
        preset's ``context_mode``, Flax's attention routed to it (:mod:`strategies.reads.attention`).
        With ``stage``: the ``pipeline=`` blocks run in stages (:mod:`strategies.reads.pipeline`)."""
        if self.context == 1 and self.stage == 1:
            return super().trace_step(call, state, arrays, layouts, shardings)
        plan = self.pipeline_plan() if self.stage > 1 else None

        def routed(state: Any, arrays: Any, *, prepare: Any = None) -> Any:
            def both(nodes: Any) -> None:
                if self.context > 1:
                    route_attention_fns(nodes)
                if prepare is not None:
                    prepare(nodes)
                if plan is not None:  # over the classes the reads gave the blocks
                    prepare_lists(nodes, plan)

            return call(state, arrays, prepare=both)

        with contextlib.ExitStack() as stack:
            if self.context > 1:
                stack.enter_context(_context_mode(self.context_mode))
                stack.enter_context(routed_flax_attention())
            if plan is not None:
                stack.enter_context(pipelined(plan))
            out = super().trace_step(routed, state, arrays, layouts, shardings)
        if plan is not None and not plan.runs and self._stacks:
            raise PipelineError(
                f"HybridStrategy(stage={self.stage}, pipeline=({', '.join(c.__name__ for c in self.pipeline)},)): "
                "the step ran no blocks of those classes in stages. A scanned stack is pipelined "
                "where the step calls flax.nnx.scan over it (looked up as nnx.scan, "
                "out_axes=nnx.Carry); a list where its first block is called. Name the class of "
                "the blocks the model repeats, or drop stage=."
            )
        return out

    def pipeline_plan(self) -> PipelinePlan:
        """How a step's ``pipeline=`` blocks run in stages (a fresh plan per trace)."""
        return PipelinePlan(
            classes=self.pipeline,
            stages=self.stage,
            microbatches=self.microbatches,
            repeats=self._rounds(),
            axis=_S,
            batch_axes=self.batch_axes,
            # With remat=: each tick recomputed whole (its layer's weights read inside it,
            # so it keeps its input alone); the blocks' own remat is skipped there.
            remat=bool(self.remat),
            policy=None,
            preset=type(self).__name__,
        )

    def kept_axes(self, path: str) -> tuple[str, ...]:
        """Mesh axes a read of ``path`` keeps split (an expert stack keeps ``expert``)."""
        return (_E,) if self.expert > 1 and "experts" in path.split("/") else ()

    def activation_bytes_min(self, state: Any, rules: Any, batch: list[Any]) -> float:
        """Megatron's per-layer activation all-reduces over ``tensor``, per device.

        Each row-parallel kernel's output is all-reduced in the forward pass and
        the matching column-parallel layer's input gradient in the backward
        pass (2 all-reduces of ``tokens x out_features``); a vocab-parallel
        embedding's lookup is all-reduced once. ``tokens`` is the first batch
        array's elements per data shard (all of them for integer token ids,
        all but the last dimension for float features; the first layer's
        input gradient is not all-reduced when its input is the float
        batch, which needs none). Ring model:
        ``2(t-1)/t`` bytes per byte all-reduced.
        """
        t = self.mesh.shape["tensor"]
        arrays = [a for a in batch if a is not None and len(np.shape(a))]
        if t == 1 or not arrays or state is None or rules is None:
            return 0.0
        first = arrays[0]
        shape = np.shape(first)
        integer = np.issubdtype(np.dtype(first.dtype), np.integer)
        tokens = math.prod(shape if integer else shape[:-1]) / self.num_replicas_in_sync
        total = 0.0
        first_row = 0.0
        leaves = jax.tree_util.tree_leaves_with_path(
            state, is_leaf=lambda v: hasattr(v, "get_value")
        )
        rule_leaves = jax.tree.leaves(rules, is_leaf=lambda v: v is None or isinstance(v, str))
        for (path, leaf), rule in zip(leaves, rule_leaves, strict=False):
            p = path_str(path)
            if not rule or "opt_state" in p.split("/"):
                continue
            value = leaf_value(leaf)
            item = np.dtype(value.dtype).itemsize
            features = np.shape(value)[-1]
            if rule.startswith("megatron row") and p.endswith("kernel"):
                total += 2 * tokens * features * item
                first_row = first_row or tokens * features * item
            elif rule == "megatron vocab":
                total += tokens * features * item
        if not integer:
            # The input of the first (column-parallel) layer is the batch, whose gradient
            # no one needs: its all-reduce in the backward pass never happens.
            total -= first_row
        return total * 2 * (t - 1) / t

    def read_options(self) -> ReadOptions:
        """Gather ``fsdp``-split reads (``gather_at_read``), reshard, remat, casts."""
        fsdp = self.mesh.shape["fsdp"] > 1
        gather = fsdp and self.gather_at_read
        return ReadOptions(
            axes=self.batch_axes if gather else ("fsdp", _C) if self.context > 1 else ("fsdp",),
            gather=gather,
            # Every mesh axis Explicit when gathering (``tensor`` is 1): JAX types the
            # gathered ``reduced`` weights and their ``unreduced`` gradients only then.
            explicit_axes=self.mesh.dim_names if gather else (),
            # XLA's own plan decides by itself what to keep, as FullyShardedStrategy's: the
            # wrappers would rematerialise each owner's whole call, and an owner holding the
            # ``remat=`` blocks (a decoder owning its embedding) swallowed them (llama2-70b,
            # tensor=4: every layer's attention scores kept across the scan, 1019 GiB a chip).
            reshard_after_forward=self.reshard_after_forward and gather,
            remat=self.remat,
            remat_policy=self._policy,
            mixed_precision=self.mixed_precision,
            preset=type(self).__name__,
            batch_axes=() if gather else self.batch_axes,
            # Each layer of a scanned stack gathered over fsdp in the loop body (measured,
            # llama2-70b tensor=4 on v5p:4x4x4: the same peak, ICI bytes 199 -> 164 GiB).
            layer_gather=not gather and bool(self.remat),
            # ... and each layer's inputs split along the sequence over ``tensor`` (Megatron's
            # sequence parallelism), so the layer inputs kept for the backward pass are not
            # copied on each ``tensor`` device (tensor=4: 27.7 -> 24.7 GiB a chip).
            # With ``context``, the sequence stays split over it through every layer.
            sequence_axes=tuple(
                a for a in (_C, "tensor") if not gather and self.mesh.shape.get(a, 1) > 1
            ),
            # ... but an expert stack's layer stays split over ``expert``: dtensor.expert_mlp
            # runs each device's experts where they are.
            kept_axes=self.kept_axes if self.expert > 1 else None,
            layer_gather_axes=(_C,) if self.context > 1 else (),
        )

    def rule_name(self, path: str, leaf: Any) -> str | None:
        _, rule = self._tensor_specs(path, leaf)
        kind = self._stack_kind(path) if self.stage > 1 else None
        if kind is not None:
            return f"pipeline {kind}" + (f", {rule}" if rule else "")
        if rule is None and self.mesh.shape["tensor"] > 1:
            return None  # no tensor rule matched: reported as unmatched
        return rule or self.name


def _node_at(root: Any, path: tuple[Any, ...]) -> Any:
    for p, node in nnx.iter_graph(root):
        if tuple(p) == tuple(path):
            return node
    raise KeyError(path)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this library and Flax."""
    ours = ("strategies", "dtensor", "flax", "jax", "contextlib")
    frame, level = sys._getframe(1), 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in ours:
            return level
        frame, level = frame.f_back, level + 1
    return 1


class TensorParallelStrategy(HybridStrategy):
    """Megatron tensor parallelism over ``tensor_parallel`` devices, data parallel across the rest.

    Examples:
        >>> import strategies, jax.numpy as jnp
        >>> s = strategies.TensorParallelStrategy(tensor_parallel=2)
        >>> s.mesh
        Mesh(data=4, fsdp=1, tensor=2)
        >>> s.variable_layout("mlp/down/kernel", jnp.zeros((256, 64))).sharding_specs
        ('tensor', 'unsharded')
    """

    name = "tensor_parallel"

    def __init__(
        self,
        tensor_parallel: int = 2,
        *,
        rules: LayoutMap | Sequence[tuple[str, Sequence[Any]]] | None = None,
        devices: Sequence[Any] | None = None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        super().__init__(
            data=-1,
            fsdp=1,
            tensor=tensor_parallel,
            rules=rules,
            devices=devices,
            mixed_precision=mixed_precision,
        )
