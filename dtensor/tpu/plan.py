"""A plan of ``python -m dtensor.aot --search``: :class:`Plan`, one configuration of
``HybridStrategy``'s six axes, ``across_slices``, the pipeline and context modes and the
memory rungs, for the model a :class:`ModelFacts` describes.

A plan is written as the training script's flags (:meth:`Plan.flags`, the
``examples/train.py`` spelling, :data:`KNOB_FLAGS`) and as the ``HybridStrategy(...)`` a
user pastes (:meth:`Plan.strategy_line`). :mod:`dtensor.tpu.plans` lists the plans a search
chooses from; :mod:`dtensor.tpu.flags` reads a command line back into a plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["AXES", "KNOB_FLAGS", "ModelFacts", "Plan"]

#: HybridStrategy's axes, in its mesh order.
AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")

#: Each knob of a plan and the script flag that turns it (``examples/train.py``'s spelling).
KNOB_FLAGS = {
    "strategy": "--strategy",
    "data": "--data",
    "tensor": "--tensor",
    "stage": "--stage",
    "microbatches": "--microbatches",
    "schedule": "--schedule",
    "context": "--context",
    "context_mode": "--context-mode",
    "expert": "--expert",
    "across_slices": "--across-slices",
    "precision": "--mixed-precision",
    "remat": "--remat",
    "remat_policy": "--remat-policy",
    "scan": "--scan",
    "gather_layers": "--gather-layers",
    "offload": "--offload-optimizer",
    "reshard": "--no-reshard-after-forward",
    "loss_chunks": "--loss-chunks",
    "loss_tiling": "--loss-tiling",
}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFacts:
    """A model's shapes, as a script's ``search_facts(argv)`` hook gives them.

    ``params`` counts every parameter (tied embeddings once); ``flags`` are the script's
    flags the search may set; ``model_flops`` one step's (``None``: estimated as ``6 x
    params x tokens``); ``attention`` what the step's attention keeps (``"xla"``: float32
    scores of ``[batch, heads, seq, seq]``; a kernel's name, or ``"auto"``: none);
    ``precisions`` the ``--mixed-precision`` values the search tries (``"bf16-compute"``
    for a model whose modules pin their computation dtype, as Flax's own Gemma does: plain
    ``"bf16"`` leaves its arithmetic in float32); ``remat_policies`` the per-tensor remat
    plans (:data:`dtensor.tpu.estimate.OFFLOADED`'s names) the model names its tensors for,
    which the search tries beside ``full`` and ``dots_saveable``.
    """

    params: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    batch: int
    seq: int
    experts: int = 0
    experts_per_token: int = 0
    tied: bool = True
    attention: str = "auto"
    block: str = ""
    model_flops: float | None = None
    flags: tuple[str, ...] = ()
    precisions: tuple[str, ...] = ("none", "bf16")
    remat_policies: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, facts: dict[str, Any]) -> ModelFacts:
        """From a hook's dict; unknown keys are ignored, ``flags`` becomes a tuple."""
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in facts.items() if k in names}
        kept["flags"] = tuple(kept.get("flags", ()))
        kept["remat_policies"] = tuple(kept.get("remat_policies", ()))
        if "precisions" in kept:
            kept["precisions"] = tuple(kept["precisions"])
        return cls(**kept)

    def accepts(self, knob: str) -> bool:
        """Whether the script takes ``knob``'s flag (:data:`KNOB_FLAGS`)."""
        return KNOB_FLAGS[knob] in self.flags


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """One configuration: the six axes' sizes, the modes, and the memory rungs.

    ``preset`` is the script's ``--strategy`` (``"hybrid"``; ``"fully_sharded"`` and others
    come from :func:`plan_from_argv`). ``precision`` is ``"none"`` (float32), ``"bf16"``
    (float32 master variables, bfloat16 reads) or ``"bf16-compute"`` (and each module's
    computation dtype set to bfloat16: ``MixedPrecision(module_dtype=True)``); ``remat``
    ``"none"``, ``"full"`` (keep only block inputs) or a ``jax.checkpoint_policies`` name;
    ``reshard`` ``False`` keeps the gathered weights from the forward pass for the backward
    one.
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    stage: int = 1
    context: int = 1
    expert: int = 1
    across_slices: str | None = None
    microbatches: int = 1
    schedule: str = "gpipe"
    context_mode: str = "gather"
    precision: str = "bf16"
    remat: str = "full"
    scan: bool = False
    gather_layers: bool = False
    offload: bool = False
    reshard: bool = True
    preset: str = "hybrid"
    loss_chunks: int = 1
    loss_tiling: str = "vocab"

    @property
    def chips(self) -> int:
        """The product of the axes."""
        return self.data * self.fsdp * self.tensor * self.stage * self.context * self.expert

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return {a: getattr(self, a) for a in AXES}

    def name(self) -> str:
        """A short label: the axes above 1, then the rungs (``fsdp=8 tensor=2 bf16 remat``)."""
        parts = [f"{a}={n}" for a, n in self.sizes.items() if n > 1] or ["one chip"]
        if self.preset != "hybrid":
            parts.insert(0, self.preset)
        if self.stage > 1:
            parts.append(f"{self.schedule} x{self.microbatches}")
        if self.context > 1 and self.context_mode != "gather":
            parts.append(self.context_mode)
        if self.across_slices:
            parts.append(f"{self.across_slices} over DCN")
        names = {"none": "fp32", "bf16": "bf16", "bf16-compute": "bf16 compute"}
        parts.append(names.get(self.precision, self.precision))
        if self.remat != "none":
            parts.append("remat" if self.remat == "full" else f"remat ({self.remat})")
        parts += [w for w, on in (("scan", self.scan), ("gather layers", self.gather_layers),
                                  ("offload", self.offload), ("keep gathered", not self.reshard))
                  if on]  # fmt: skip
        if self.loss_chunks > 1:
            tokens = " by tokens" if self.loss_tiling == "tokens" else ""
            parts.append(f"loss/{self.loss_chunks}{tokens}")
        return " ".join(parts)

    def flags(self) -> list[str]:
        """The script's flags for this plan (``examples/train.py``'s spelling)."""
        out = ["--strategy", self.preset]
        if self.preset == "hybrid":
            if self.data > 1 or self.across_slices:
                out += ["--data", str(self.data)]
            for axis in ("tensor", "stage", "context", "expert"):
                if getattr(self, axis) > 1:
                    out += [KNOB_FLAGS[axis], str(getattr(self, axis))]
            if self.stage > 1:
                out += ["--microbatches", str(self.microbatches), "--schedule", self.schedule]
            if self.context > 1:
                out += ["--context-mode", self.context_mode]
            if self.across_slices:
                out += ["--across-slices", self.across_slices]
        if self.precision != "none":
            out += ["--mixed-precision", self.precision]
        if self.remat != "none":
            out.append("--remat")
            if self.remat != "full":
                out += ["--remat-policy", self.remat]
        for on, flag in ((self.scan, "--scan"), (self.gather_layers, "--gather-layers"),
                         (self.offload, "--offload-optimizer"),
                         (not self.reshard, "--no-reshard-after-forward")):  # fmt: skip
            if on:
                out.append(flag)
        if self.loss_chunks > 1:
            out += ["--loss-chunks", str(self.loss_chunks)]
            if self.loss_tiling != "vocab":
                out += ["--loss-tiling", self.loss_tiling]
        return out

    def strategy_line(self) -> str:
        """The preset to paste: ``HybridStrategy(data=1, fsdp=8, tensor=2, ...)``.

        Examples:
            >>> from dtensor.tpu.plan import Plan
            >>> Plan(fsdp=8, tensor=2).strategy_line()
            'HybridStrategy(data=1, fsdp=8, tensor=2, mixed_precision=MixedPrecision(param_dtype=jnp.bfloat16), remat=(Block,))'
        """
        if self.preset == "hybrid":
            args = [f"data={self.data}", f"fsdp={self.fsdp}", f"tensor={self.tensor}"]
            for axis in ("stage", "context", "expert"):
                if getattr(self, axis) > 1:
                    args.append(f"{axis}={getattr(self, axis)}")
            if self.stage > 1:
                args += [f"microbatches={self.microbatches}", f"schedule={self.schedule!r}"]
                args.append("pipeline=(Block,)")
            if self.context > 1:
                args.append(f"context_mode={self.context_mode!r}")
            if self.across_slices:
                args.append(f"across_slices={self.across_slices!r}")
            name = "HybridStrategy"
        else:
            args, name = [], {"fully_sharded": "FullyShardedStrategy"}.get(self.preset, "")
            if not name:
                return f"strategies.from_name({self.preset!r})"
        if self.precision != "none":
            extra = ", module_dtype=True" if self.precision == "bf16-compute" else ""
            args.append(f"mixed_precision=MixedPrecision(param_dtype=jnp.bfloat16{extra})")
        if self.remat != "none":
            args.append("remat=(Block,)")
            if self.remat != "full":
                args.append(f"remat_policy={self.remat!r}")
        if not self.reshard:
            args.append("reshard_after_forward=False")
        if self.offload:
            args.append("offload_optimizer=True")
        if self.gather_layers:
            args.append("gather_layers=True")
        return f"{name}({', '.join(args)})"
