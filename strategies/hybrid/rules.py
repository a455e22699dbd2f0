"""HybridStrategy's variable rules: Megatron on ``tensor``, experts on ``expert``, stacks on
``stage``, then FSDP over ``fsdp`` (with ``context``, and ``expert`` outside the experts).

:func:`megatron_specs` and :func:`expert_dim` are the rules by path; :class:`VariableRules`
applies them (a ``rules=`` :class:`dtensor.LayoutMap` first), warns once for a variable a
rule cannot split, and lays out the batch (the sequence over ``context``).
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

import dtensor
from dtensor import Layout, LayoutMap
from dtensor.core.tree import leaf_value
from strategies.hybrid.mesh_plan import PipelinePlanning
from strategies.placement.sharding import nbytes, shard_largest_dim

__all__ = ["VariableRules", "expert_dim", "megatron_specs"]

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


def expert_dim(path: str, shape: Sequence[int]) -> int | None:
    """The experts dimension of a stacked expert weight, by its path, or ``None``.

    The rule: a variable of rank 3 or more with a path component ``experts``
    (the module holding the stacked weights, as ``moe/experts/up``, or the
    parameter's own name, as ``moe/experts``) is ``[..., experts, in, out]``:
    its experts dimension is the third from last (a scanned stack's leading
    layer dimension comes before it).

    Examples:
        >>> from strategies.hybrid import expert_dim
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
        >>> from strategies.hybrid import megatron_specs
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


class VariableRules(PipelinePlanning):
    """Where each variable of a HybridStrategy goes, and the batch."""

    rules: LayoutMap | None
    expert: int
    context: int
    min_shard_bytes: int

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
        tensor = self.mesh.shape[_T]
        dim = expert_dim(path, shape) if self.expert > 1 or tensor > 1 else None
        if dim is not None and self.expert == 1:
            return self._expert_hidden([dtensor.UNSHARDED] * len(shape), path, shape, None)
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
            return self._expert_hidden(specs, path, shape, "expert")
        if tensor > 1:
            hit = megatron_specs(path, shape)
            if hit is not None:
                specs, rule = hit
                if self._indivisible(path, shape, specs, rule) is None:
                    return specs, f"megatron {rule}"
                return [dtensor.UNSHARDED] * len(
                    shape
                ), f"megatron {rule} (not divisible: replicated)"
        return [dtensor.UNSHARDED] * len(shape), None

    def _expert_hidden(
        self, specs: list[Any], path: str, shape: Sequence[int], rule: str | None
    ) -> tuple[list[Any], str | None]:
        """An expert stack's hidden dimension over ``tensor`` (Megatron within each expert, as
        :func:`dtensor.expert_mlp` computes it): ``gate``/``up`` ``[..., E, d, hidden]`` by
        column, ``down`` ``[..., E, hidden, d]`` by row; left whole where it does not divide."""
        n = self.mesh.shape[_T]
        name = path.split("/")[-1]
        hidden = (
            len(shape) - 2 if _ROW.match(name) else len(shape) - 1 if _COLUMN.match(name) else None
        )
        if n == 1 or hidden is None or shape[hidden] % n:
            return specs, rule
        specs[hidden] = _T
        side = "row" if hidden == len(shape) - 2 else "column"
        return specs, (f"{rule} + " if rule else "") + f"megatron expert {side}"

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

    def kept_axes(self, path: str) -> tuple[str, ...]:
        """Mesh axes a read of ``path`` keeps split (an expert stack keeps ``expert``)."""
        return (_E,) if self.expert > 1 and "experts" in path.split("/") else ()

    def rule_name(self, path: str, leaf: Any) -> str | None:
        _, rule = self._tensor_specs(path, leaf)
        kind = self._stack_kind(path) if self.stage > 1 else None
        if kind is not None:
            return f"pipeline {kind}" + (f", {rule}" if rule else "")
        if rule is None and self.mesh.shape["tensor"] > 1:
            return None  # no tensor rule matched: reported as unmatched
        return rule or self.name


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
