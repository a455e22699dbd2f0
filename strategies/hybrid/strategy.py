"""HybridStrategy: data x stage x fsdp x context x expert x tensor in one preset.

The class puts the roles of :mod:`strategies.hybrid` together: its mesh plan and pipeline
(:mod:`~strategies.hybrid.mesh_plan`), its variable rules (:mod:`~strategies.hybrid.rules`)
and its step options (:mod:`~strategies.hybrid.options`). ``strategies.HybridStrategy`` is
this class; ``TensorParallelStrategy`` is a thin preset over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from dtensor import LayoutMap
from dtensor.core.attention import MODES as CONTEXT_MODES
from strategies.hybrid.mesh_plan import mesh_dims
from strategies.hybrid.options import StepOptions, check_gather_at_read
from strategies.placement.slices import slice_mesh
from strategies.reads.mixed_precision import MixedPrecision
from strategies.reads.swaps import check_remat
from strategies.reads.swaps import remat_policy as remat_policy_fn

__all__ = ["HybridStrategy"]


class HybridStrategy(StepOptions):
    """Every parallelism in one preset: a ``("data", "fsdp", "tensor")`` mesh, Megatron rules
    on ``tensor``, then FSDP on the largest remaining dimension over ``fsdp``; the batch
    split over ``data`` and ``fsdp``. With ``stage=S``, ``context=C`` and ``expert=E``, a
    ``("data", "stage", "fsdp", "context", "expert", "tensor")`` mesh (``context`` before
    ``fsdp`` when there is a ``stage`` axis; :func:`strategies.hybrid.mesh_plan.mesh_dims`)
    for pipelines, long sequences and mixtures of experts.

    Its roles live in :mod:`strategies.hybrid`: the mesh plan and the pipeline over
    ``stage`` (:mod:`~strategies.hybrid.mesh_plan`), the variable rules
    (:mod:`~strategies.hybrid.rules`), the step options (:mod:`~strategies.hybrid.options`).

    Args:
        data: data-parallel size (``-1``: whatever the devices leave).
        fsdp: fully-sharded size.
        tensor: tensor-parallel size. Under XLA's plan with ``remat=`` on a scanned
            stack, each layer's inputs kept for the backward pass are split along the
            sequence over ``tensor``, and each sublayer holding ``tensor``-split weights
            (attention, the MLP) takes its input gathered over ``tensor`` and
            reduce-scatters its output (Megatron's sequence parallelism).
        expert: expert-parallel size. Stacked expert weights (the rule of
            :func:`~strategies.hybrid.rules.expert_dim`: rank 3 or more under a path component
            ``experts``, ``[..., experts, in, out]``) split their experts
            dimension over ``expert`` (and FSDP's largest other dimension over
            ``fsdp``); every other variable is FSDP-split over ``fsdp`` and
            ``expert`` together, as MaxText shards them; the batch is split
            over ``data``, ``fsdp`` and ``expert``. An MoE layer dispatches
            its tokens by calling :func:`dtensor.expert_mlp` (all-to-alls over
            ``expert``); the rest of the model is data parallel over it. It
            needs ``gather_at_read`` off (``None`` then means ``False``).
        context: context-parallel size (long sequences). A ``context`` mesh
            axis (after ``fsdp``, or after ``stage`` when there is one): every batch array of rank 2
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
            ``context``, MaxText's default), ``"ring"`` (passed round a ring of
            collective permutes, causal attention load-balanced) or ``"ulysses"``
            (all-to-alls from the sequence split to a head split around
            attention and back; the heads must divide over ``context``, key/value
            heads are repeated where fewer) or ``"usp"`` (Ulysses within groups of
            ``gcd(context, heads)`` consecutive devices, a ring across the
            groups: any head count); see :mod:`dtensor.core.attention`.
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
        dims = mesh_dims(data, fsdp, tensor, stage=stage, context=context, expert=expert)
        if context_mode not in CONTEXT_MODES:
            raise ValueError(
                f"HybridStrategy(context_mode={context_mode!r}): valid modes are "
                f"{CONTEXT_MODES} ('gather': keys and values all-gathered over 'context'; "
                "'ring': passed round a ring of collective permutes; 'ulysses': all-to-alls "
                "to a head split around attention and back; 'usp': Ulysses within groups, a "
                "ring across them)."
            )
        self._check_pipeline(stage, microbatches, schedule, repeats, pipeline)
        mesh, self.across_slices = slice_mesh(dims, devices, across_slices)
        self.expert = expert
        self.context = context
        self.context_mode = context_mode
        self.gather_at_read = check_gather_at_read(
            gather_at_read,
            devices,
            mesh.shape["tensor"],
            stage=stage,
            context=context,
            expert=expert,
        )
        self.reshard_after_forward = bool(reshard_after_forward)
        self.remat = check_remat(remat)
        self.remat_policy = remat_policy
        self._policy = remat_policy_fn(remat_policy)
        batch = ("data", "fsdp", "expert") if expert > 1 else ("data", "fsdp")
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
