"""Presets by name (for command lines: the demo's ``--strategy``, ``dtensor.aot``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

import dtensor
from strategies.base import Strategy
from strategies.partitioners import FixedShardsPartitioner
from strategies.presets.central_storage import CentralStorageStrategy
from strategies.presets.fsdp import FullyShardedStrategy
from strategies.presets.hybrid import HybridStrategy
from strategies.presets.layout_strategy import LayoutStrategy
from strategies.presets.mirrored import MirroredStrategy
from strategies.presets.multi_worker_mirrored import MultiWorkerMirroredStrategy
from strategies.presets.one_device import OneDeviceStrategy
from strategies.presets.parameter_server import ParameterServerStrategy
from strategies.presets.tensor_parallel import TensorParallelStrategy
from strategies.presets.tpu import TPUStrategy

__all__ = ["PRESET_NAMES", "describe_presets", "from_name"]


def _factor(n: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) for ``n`` devices: tensor 2 and fsdp 2 where they fit."""
    tensor = 2 if n % 2 == 0 else 1
    fsdp = 2 if (n // tensor) % 2 == 0 else 1
    return n // (tensor * fsdp), fsdp, tensor


def _layout(devices: Sequence[Any]) -> Strategy:
    n = len(devices)
    model = 2 if n % 2 == 0 else 1
    mesh = dtensor.create_mesh([("batch", n // model), ("model", model)], devices=devices)
    rules = dtensor.LayoutMap(
        mesh,
        [
            (r"(query|key|value)/kernel", (None, "model", None)),  # (in, heads, head_dim)
            (r"attn/out/kernel", ("model", None, None)),
            (r"up/kernel", (None, "model")),
            (r"down/kernel", ("model", None)),
        ],
    )
    return LayoutStrategy(mesh, rules)


_PRESETS: dict[str, tuple[str, Callable[[Sequence[Any]], Strategy]]] = {
    "one_device": (
        "everything on one device (one per process in a job of several)",
        lambda d: OneDeviceStrategy(devices=d),
    ),
    "mirrored": ("replicated variables, batch split (one host)", lambda d: MirroredStrategy(d)),
    "multi_worker_mirrored": (
        "replicated variables, batch split over all processes",
        lambda d: MultiWorkerMirroredStrategy(d),
    ),
    "central_storage": (
        "one copy of the variables, compute on all devices",
        lambda d: CentralStorageStrategy(devices=d),
    ),
    "tpu": ("replicated variables over TPU cores", lambda d: TPUStrategy(devices=d)),
    "parameter_server": (
        "variables split over 2 parameter devices, sync data parallel",
        lambda d: ParameterServerStrategy(FixedShardsPartitioner(2), devices=d),
    ),
    "fully_sharded": (
        "ZeRO-3: every variable split over all devices",
        lambda d: FullyShardedStrategy(d, min_shard_bytes=0),
    ),
    "tensor_parallel": (
        "Megatron column/row over 2 devices, data across",
        lambda d: TensorParallelStrategy(2, devices=d),
    ),
    "hybrid": (
        "data x fsdp x tensor",
        lambda d: HybridStrategy(*_factor(len(d)), min_shard_bytes=0, devices=d),
    ),
    "layout": ("a LayoutMap over a (batch, model) mesh", _layout),
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def from_name(name: str, devices: Sequence[Any] | None = None) -> Strategy:
    """A preset with sensible settings for a command line, by name.

    Examples:
        >>> import strategies
        >>> strategies.from_name("fully_sharded").mesh
        Mesh(fsdp=8)
        >>> strategies.from_name("mirrored", devices=__import__("jax").devices()[:4]).num_replicas_in_sync
        4
    """
    key = name.replace("-", "_").lower()
    if key not in _PRESETS:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(PRESET_NAMES)}.")
    return _PRESETS[key][1](list(devices) if devices is not None else jax.devices())


def describe_presets() -> list[tuple[str, str]]:
    """``(name, one-line description)`` for every preset."""
    return [(n, d) for n, (d, _) in _PRESETS.items()]
