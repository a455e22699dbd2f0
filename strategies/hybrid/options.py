"""HybridStrategy's step options: what a traced step does on each axis.

:func:`check_gather_at_read` resolves ``gather_at_read`` (refused where an axis other than
``data`` and ``fsdp`` has more than one device); :class:`StepOptions` traces a step with
the context axis's attention and the stage axis's pipeline, sets the parameter reads
(:class:`strategies.reads.param_reads.ReadOptions`: FSDP gathers, casts, remat, sequence
parallelism) and counts Megatron's activation all-reduces for the minimum.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dtensor.core.attention import context_mode as _context_mode
from dtensor.core.tree import leaf_value, path_str
from strategies.hybrid.rules import VariableRules
from strategies.reads.attention import route_attention_fns, routed_flax_attention
from strategies.reads.param_reads import ReadOptions
from strategies.reads.pipeline import PipelineError, pipelined, prepare_lists
from strategies.reads.pipeline_grad import scheduled_grads

__all__ = ["StepOptions", "check_gather_at_read"]

_E = "expert"
_C = "context"


def check_gather_at_read(
    gather_at_read: bool | None,
    devices: Sequence[Any],
    tensor: int,
    *,
    stage: int,
    context: int,
    expert: int,
) -> bool:
    """``gather_at_read`` resolved: ``None`` is ``True`` on CPU with every axis but ``data``
    and ``fsdp`` of size 1; ``True`` with such an axis larger is refused with the fix."""
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
            and tensor == 1
            and expert == 1
            and context == 1
            and stage == 1
        )
    elif gather_at_read and tensor > 1:
        raise ValueError(
            f"HybridStrategy(gather_at_read=True) needs tensor=1 (got tensor="
            f"{tensor}): gathering at reads traces the step with every mesh "
            "axis Explicit, where a row-parallel (Megatron) matmul's sharded contraction "
            "has no defined output layout. Pass tensor=1, or gather_at_read=False (or None) "
            "to leave the fsdp gathers to XLA."
        )
    return bool(gather_at_read)


class StepOptions(VariableRules):
    """How a HybridStrategy traces a step and reads its parameters."""

    context_mode: str
    gather_at_read: bool
    reshard_after_forward: bool
    _policy: Any

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
                stack.enter_context(scheduled_grads(plan))
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
            # ... gathered back over ``tensor`` by each sublayer holding tensor-split weights
            # (attention, the MLP), its output split again: Megatron's plan. Left to XLA, each
            # weight was gathered over ``tensor`` instead (llama2-70b tensor=4 on v5p:4x4x4:
            # 21.5 -> 20.0 GiB a chip, ICI 976 -> 364 ms with the sublayers' gathers).
            layer_sequence_axes=(_C,) if self.context > 1 else (),
            # ... but an expert stack's layer stays split over ``expert``: dtensor.expert_mlp
            # runs each device's experts where they are.
            kept_axes=self.kept_axes if self.expert > 1 else None,
            layer_gather_axes=(_C,) if self.context > 1 else (),
            # Without remat=, each layer of a scanned stack keeps the batch (and context's
            # sequence) split all the same; a pipeline's stages run their own layers.
            layer_batch_split=not gather and not self.remat and self.stage == 1,
        )
