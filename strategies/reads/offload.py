"""Variables kept in host memory between steps (``memory_kind="pinned_host"``).

A preset says which variables live in host memory through
``Strategy.memory_kind(path, leaf)``; the step compiler moves them to their
compute layout in device memory before each step and back after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["HOST_MEMORY", "check_host_memory", "has_host_memory", "to_device", "to_host"]

HOST_MEMORY = "pinned_host"


def has_host_memory(device: Any) -> bool:
    """Whether ``device`` exposes a ``pinned_host`` memory.

    Examples:
        >>> import jax
        >>> from strategies.reads.offload import has_host_memory
        >>> has_host_memory(jax.devices()[0])
        True
    """
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - a device (or topology stub) without memory spaces
        return False
    return HOST_MEMORY in kinds


def check_host_memory(devices: Sequence[Any], what: str) -> None:
    """Raise if some of ``devices`` have no host memory kind to offload to.

    A device of another process (a multi-host topology's, as ``dtensor.aot``
    compiles for) lists no memories at all; it is judged by those that do.
    """
    seen = [d for d in devices if _memories(d)]
    missing = [d for d in seen or devices if not has_host_memory(d)]
    if missing:
        d = missing[0]
        raise ValueError(
            f"{what} keeps state in host memory (memory_kind={HOST_MEMORY!r}), but device "
            f"{d} ({d.platform}) offers no such memory (it has "
            f"{sorted(m.kind for m in _memories(d))}); offload needs a platform with host "
            "memory kinds (TPU, GPU, or CPU in JAX >= 0.5). Run without offload on this platform."
        )


def _memories(device: Any) -> list[Any]:
    try:
        return list(device.addressable_memories())
    except Exception:  # noqa: BLE001
        return []


def to_host(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` laid out as ``sharding`` in host memory (through one device-memory copy)."""
    device = sharding.with_memory_kind("device")
    if _across_device_sets(x, device):
        x = _placed_by_each_process(x, device)
    elif x.sharding != device:
        x = jax.device_put(x, device)  # a direct move between meshes and memories fails
    return jax.device_put(x, sharding.with_memory_kind(HOST_MEMORY))


def to_device(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` (in host memory) laid out as ``sharding`` in device memory."""
    if x.sharding.memory_kind != "device":
        x = jax.device_put(x, x.sharding.with_memory_kind("device"))
    if _across_device_sets(x, sharding):
        return _placed_by_each_process(x, sharding.with_memory_kind("device"))
    return jax.device_put(x, sharding.with_memory_kind("device"))


def _across_device_sets(x: jax.Array, sharding: jax.sharding.Sharding) -> bool:
    """A move between device sets in a job of several processes: ``device_put`` cannot
    make it (JAX reshards across hosts only within one device set)."""
    return (
        not x.is_fully_addressable
        and x.is_fully_replicated
        and bool(x.addressable_shards)
        and x.sharding.device_set != sharding.device_set
    )


def _placed_by_each_process(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """A replicated ``x`` onto ``sharding``: each process places its own blocks from its copy."""
    import numpy as np

    local = np.asarray(x.addressable_data(0))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: local[index])
