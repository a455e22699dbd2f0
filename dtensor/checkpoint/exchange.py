"""Bytes between processes over JAX's own collectives: to a peer in a ring, or to everyone.

The local checkpoint tier copies each process's shards to a peer process, and a
restarted job sends a replaced process its shards back from that peer. Both
move host bytes between processes with the collectives the job already has
(gloo on CPU, ICI/DCN on TPU, NCCL on GPU): a ``(processes, n)`` ``uint32``
array, one row on one device of each process, moved by ``ppermute`` over a
one-device-per-process mesh. No side channel (sockets, shared files) is needed,
and nothing but the ring's neighbours' rows is sent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["CHUNK_BYTES", "allgather_bytes", "peer_shift", "send_bytes"]

CHUNK_BYTES = 128 << 20
"""Bytes a process sends per collective (one compiled program for every piece)."""


def _one_device_per_process() -> list[Any]:
    first: dict[int, Any] = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        first.setdefault(d.process_index, d)
    return [first[p] for p in sorted(first)]


def _lengths(n: int) -> list[int]:
    from jax.experimental import multihost_utils

    got = multihost_utils.process_allgather(np.array([n], np.int64))
    return [int(v) for v in np.asarray(got).reshape(-1)]


def _as_words(payload: Any, words: int) -> np.ndarray:
    if len(payload) == words * 4:  # no padding needed: a view, not a copy
        return np.frombuffer(payload, np.uint32).reshape(1, words)
    buf = np.zeros(words * 4, np.uint8)
    buf[: len(payload)] = np.frombuffer(payload, np.uint8)
    return buf.view(np.uint32).reshape(1, words)


def send_bytes(payload: Any, pairs: Sequence[tuple[int, int]], *, wait: bool = True) -> Any:
    """Every process calls this; ``(source, destination)`` pairs say who sends its ``payload`` to whom.

    ``payload`` is any bytes-like object. Returns the bytes this process
    received, as a ``memoryview`` (``None`` when no pair names it as the
    destination). Each process is the destination of at most one pair. With
    ``wait=False`` the transfer is only dispatched (JAX runs it in the
    background, ordered before whatever the devices run next) and a function
    is returned that waits for it and gives the received bytes: another thread
    may call it while training goes on.

    Examples:
        >>> from dtensor.checkpoint.exchange import send_bytes
        >>> bytes(send_bytes(b"abc", [(0, 0)]))  # one process: to itself
        b'abc'
    """
    count, me = jax.process_count(), jax.process_index()
    dests = [d for _, d in pairs]
    if len(set(dests)) != len(dests) or any(not 0 <= p < count for pair in pairs for p in pair):
        raise ValueError(f"pairs {list(pairs)} must name distinct destinations among {count}.")
    if me not in {s for s, _ in pairs}:
        payload = b""  # nothing to send: no padding for it
    lengths = _lengths(len(payload))
    source = {d: s for s, d in pairs}
    if count == 1:
        got = memoryview(payload) if 0 in source else None
        return got if wait else (lambda: got)
    total = max(lengths)
    chunk = min(CHUNK_BYTES, -(-max(1, total) // 4) * 4)  # one compiled shape for every piece
    devices = _one_device_per_process()
    mesh = jax.sharding.Mesh(np.array(devices), ("process",))
    spec = jax.sharding.PartitionSpec("process")
    sharding = jax.sharding.NamedSharding(mesh, spec)
    move = _ppermute(mesh, spec, tuple(pairs))
    view, moved = memoryview(payload), []
    for at in range(0, max(1, total), chunk):
        row = jax.device_put(_as_words(view[at : at + chunk], chunk // 4), devices[me])
        rows = jax.make_array_from_single_device_arrays((count, chunk // 4), sharding, [row])
        with jax.set_mesh(mesh):  # not the caller's mesh (a restore runs under the strategy's)
            moved.append(move(rows))

    def received() -> Any:
        if me not in source:
            return None
        out = np.empty(len(moved) * chunk, np.uint8)
        for i, piece in enumerate(moved):
            got = np.asarray(piece.addressable_shards[0].data).reshape(-1).view(np.uint8)
            out[i * chunk : (i + 1) * chunk] = got
        return memoryview(out.data)[: lengths[source[me]]]

    return received() if wait else received


@functools.lru_cache(maxsize=64)
def _ppermute(
    mesh: jax.sharding.Mesh, spec: jax.sharding.PartitionSpec, pairs: tuple
) -> Callable[[jax.Array], jax.Array]:
    def body(x: jax.Array) -> jax.Array:
        return jax.lax.ppermute(x, "process", perm=pairs)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def allgather_bytes(payload: bytes) -> list[bytes]:
    """Every process's ``payload``, in process order (for small records: each process gets all).

    Examples:
        >>> from dtensor.checkpoint.exchange import allgather_bytes
        >>> allgather_bytes(b"xy")
        [b'xy']
    """
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return [payload]
    lengths = _lengths(len(payload))
    words = max(1, -(-max(lengths) // 4))
    got = np.asarray(multihost_utils.process_allgather(_as_words(payload, words)))
    got = got.reshape(len(lengths), words)
    return [got[p].view(np.uint8)[:n].tobytes() for p, n in enumerate(lengths)]


def peer_shift(count: int | None = None) -> int:
    """How far along the ring of processes each one's peer copy goes.

    One process on: the next process, or where devices carry ``slice_index``
    (TPU slices), the same position in the next slice, so that the loss of a
    whole slice loses no shard. ``0`` for a single process (no peer).
    """
    count = jax.process_count() if count is None else count
    if count == 1:
        return 0
    slices = {getattr(d, "slice_index", None) for d in jax.devices()}
    if None in slices or len(slices) < 2 or count % len(slices):
        return 1
    return count // len(slices)
