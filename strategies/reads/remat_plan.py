"""A per-tensor memory plan: keep each activation on device, offload it to host, or recompute it.

``remat=(Block,)`` recomputes each block in the backward pass from its input.
``remat_policy=`` says, per tensor inside those blocks, what is done instead:

- ``"device"``: kept in device memory (not recomputed);
- ``"offload"``: copied to host memory (``pinned_host``) in the forward pass
  and back for the backward pass (the copies overlap compute);
- ``"remat"`` (anything not named): recomputed.

Tensors are named three ways:

- by ``jax.ad_checkpoint.checkpoint_name`` in the model's code: the example
  decoder names MaxText's (:data:`DECODER_NAMES`), so MaxText's policies
  (:data:`PRESETS`: ``"save_qkv_proj"``, ``"qkv_proj_offloaded"``,
  ``"minimal_offloaded"``...) mean the same tensors;
- by module class and ``"input"`` or ``"output"``, for a model we did not
  write: ``(Block, "input")`` is each block's input, ``(nnx.LinearGeneral,
  "output")`` each projection's output in Flax's ``MultiHeadAttention``; the
  strategy tags those calls inside the traced step without changing the model;
- a module class alone means its output.

Examples:
    >>> from strategies.reads.remat_plan import RematPolicy, parse
    >>> parse("qkv_proj_offloaded")
    RematPolicy(device=(), offload=('query_proj', 'key_proj', 'value_proj'))
    >>> parse("decoder_layer_input=offload,out_proj=device")
    RematPolicy(device=('out_proj',), offload=('decoder_layer_input',))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

__all__ = ["DECODER_NAMES", "PRESETS", "RematPolicy", "parse", "tag_name"]

#: The activations the example decoder names (MaxText's names for the same tensors): a
#: block's input, the attention projections and their context, the MLP's two inputs
#: (gate and up, before the activation) and its output.
DECODER_NAMES = (
    "decoder_layer_input",
    "query_proj",
    "key_proj",
    "value_proj",
    "context",
    "out_proj",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
)
_QKV = ("query_proj", "key_proj", "value_proj")
_DOTS = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
CHOICES = ("device", "offload", "remat")
WHERE = ("input", "output")


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """Which tensors of a ``remat=`` block stay on device or go to host; the rest are recomputed.

    Each entry is a ``checkpoint_name`` (a string), a module class (its
    output) or ``(ModuleClass, "input" | "output")``.

    Examples:
        >>> import strategies
        >>> from flax import nnx
        >>> p = strategies.RematPolicy(offload=((nnx.Linear, "input"),), device=("query_proj",))
        >>> p.names()
        (('query_proj',), ('Linear.input',))
    """

    device: tuple[Any, ...] = ()
    offload: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        for field in ("device", "offload"):
            entries = getattr(self, field)
            if isinstance(entries, str | type):
                entries = (entries,)
            object.__setattr__(self, field, tuple(_entry(e, field) for e in entries))
        both = set(self.device) & set(self.offload)
        if both:
            raise ValueError(
                f"RematPolicy names {sorted(map(str, both))} both to keep on device and to "
                "offload; name each tensor once."
            )

    @classmethod
    def from_mapping(cls, choices: Mapping[Any, str]) -> RematPolicy:
        """From ``{tensor: "device" | "offload" | "remat"}`` (MaxText's ``custom`` policy)."""
        device, offload = [], []
        for key, choice in choices.items():
            if choice not in CHOICES:
                raise ValueError(
                    f"remat_policy gives {key!r} the choice {choice!r}; valid choices are "
                    f"{CHOICES} (keep on device, offload to host memory, recompute)."
                )
            if choice == "device":
                device.append(key)
            elif choice == "offload":
                offload.append(key)
        return cls(device=tuple(device), offload=tuple(offload))

    def names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The ``checkpoint_name`` of each entry: ``(kept on device, offloaded)``."""
        return tuple(map(tag_name, self.device)), tuple(map(tag_name, self.offload))

    def tags(self) -> tuple[tuple[type, str, str], ...]:
        """``(module class, "input" | "output", name)`` of each entry naming a module call."""
        return tuple(
            (e[0], e[1], tag_name(e)) for e in (*self.device, *self.offload) if isinstance(e, tuple)
        )

    @functools.cached_property
    def jax_policy(self) -> Any:
        """The ``jax.checkpoint`` policy (one object per plan: compiled steps are cached by it)."""
        device, offload = self.names()
        inner = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(device),
            names_which_can_be_offloaded=list(offload),
            offload_src="device",
            offload_dst="pinned_host",
        )
        return NamedPolicy(inner, self)


class NamedPolicy:
    """A ``jax.checkpoint`` policy that records the ``checkpoint_name``\\ s it was asked about,
    so that a plan naming a tensor the model never names is an error, not a silent no-op."""

    def __init__(self, inner: Any, plan: RematPolicy) -> None:
        self.inner = inner
        self.plan = plan
        self.seen: set[str] = set()
        self.asked = False

    def __call__(self, prim: Any, *args: Any, **params: Any) -> Any:
        self.asked = True
        if "name" in params and getattr(prim, "name", "") == "name":
            self.seen.add(params["name"])
        return self.inner(prim, *args, **params)

    @property
    def tags(self) -> tuple[tuple[type, str, str], ...]:
        return self.plan.tags()

    def reset(self) -> None:
        self.seen, self.asked = set(), False

    def check(self) -> None:
        """Raise if the step was differentiated but never named a tensor the plan names."""
        if not self.asked:
            return
        device, offload = self.plan.names()
        missing = [n for n in (*device, *offload) if n not in self.seen]
        if missing:
            raise ValueError(
                f"remat_policy names {missing}, which no rematerialised block of the step names; "
                f"its blocks name {sorted(self.seen) or 'nothing'}. Name tensors inside the "
                "remat= blocks: a checkpoint_name in the model's code, or a module class with "
                "'input' or 'output' (e.g. (Block, 'input'), (nnx.Linear, 'output'))."
            )


def parse(value: Any) -> Any:
    """``remat_policy=`` as a :class:`RematPolicy` where it names tensors (else as given).

    A preset name (:data:`PRESETS`), ``"name=choice,..."`` (the command line's form of
    MaxText's ``custom`` policy), a ``{tensor: choice}`` mapping, or a :class:`RematPolicy`.
    Anything else (``None``, a ``jax.checkpoint_policies`` name, a callable) is returned as is.
    """
    if isinstance(value, str) and value in PRESETS:
        return PRESETS[value]
    if isinstance(value, str) and "=" in value:
        choices = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            name, sep, choice = part.partition("=")
            if not sep:
                raise ValueError(
                    f"remat_policy={value!r}: {part!r} is not name=choice; write e.g. "
                    "'decoder_layer_input=offload,query_proj=device'."
                )
            choices[name.strip()] = choice.strip()
        return RematPolicy.from_mapping(choices)
    if isinstance(value, Mapping):
        return RematPolicy.from_mapping(value)
    return value


def tag_name(entry: Any) -> str:
    """The ``checkpoint_name`` an entry stands for (``(Block, "input")``: ``"Block.input"``)."""
    if isinstance(entry, str):
        return entry
    cls, where = entry
    return f"{cls.__name__}.{where}"


def _entry(entry: Any, field: str) -> Any:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, type):
        entry = (entry, "output")
    if (
        isinstance(entry, tuple)
        and len(entry) == 2
        and isinstance(entry[0], type)
        and issubclass(entry[0], nnx.Module)
        and entry[1] in WHERE
    ):
        return entry
    raise TypeError(
        f"RematPolicy({field}=...) holds {entry!r}; valid entries are a checkpoint_name "
        "(a string), an nnx.Module class (its output) or (ModuleClass, 'input' | 'output')."
    )


#: MaxText's remat policies (``remat_policy`` in its configs) by name, for the decoder's
#: tensors: the fastest keep most. ``"full"``: nothing but each block's input (``None``).
PRESETS: dict[str, RematPolicy | str | None] = {
    "full": None,
    "minimal": "checkpoint_dots_with_no_batch_dims",
    "save_dot_with_context_except_mlp": RematPolicy(device=(*_QKV, "context", "out_proj")),
    "save_dot_except_mlpwi": RematPolicy(device=(*_QKV, "out_proj", "mlpwo")),
    "save_dot_except_mlp": RematPolicy(device=(*_QKV, "out_proj")),
    "save_qkv_proj": RematPolicy(device=_QKV),
    "save_out_proj": RematPolicy(device=("out_proj",)),
    "qkv_proj_offloaded": RematPolicy(offload=_QKV),
    "minimal_offloaded": RematPolicy(offload=_DOTS),
    "layer_input_offloaded": RematPolicy(offload=("decoder_layer_input",)),
}
