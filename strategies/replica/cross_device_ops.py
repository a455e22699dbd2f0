"""Cross-device ops: how a data-parallel step reduces its gradients across replicas.

tf.distribute lets users pick the gradient all-reduce; here each choice has a
meaning in XLA terms, visible in ``strategy.explain(step, args)``:

============================  =========================================================
choice                        what the compiled step contains (per gradient pack)
============================  =========================================================
default (``None``,            XLA partitions the global step and emits the all-reduce
``AllReduceCrossDeviceOps()``) itself: one combined all-reduce of every gradient.
``AllReduceCrossDeviceOps(    one all-reduce per pack (gradients concatenated into
num_packs=k | bytes_per_pack)``  packs, reduced in order: *bucketing*)
``NcclAllReduce()``           the default, on GPUs only (XLA's all-reduce *is* NCCL there)
``ReductionToOneDevice()``    ``n-1`` collective-permutes into one device, the sum
                              there, ``n-1`` collective-permutes back out (broadcast)
``HierarchicalCopyAllReduce`` a reduce-scatter within each group (the ICI / host axis),
                              an all-reduce across groups (the DCN axis) on the
                              scattered piece, an all-gather within the group
``CommunicationOptions(       a ring: ``2(n-1)`` collective-permutes (reduce-scatter
implementation=RING)``        ring then all-gather ring), XLA's choice of algorithm
                              replaced by an explicit one
============================  =========================================================

Which to pick: the default almost always (XLA overlaps and combines its
all-reduce, and on TPU/GPU forms reduce-scatters itself). Bucketing
(``bytes_per_pack``) bounds the size of each collective, which helps overlap
on GPUs with large models and keeps peak buffer sizes down;
``HierarchicalCopyAllReduce`` pays on multi-host meshes where the DCN link is
much slower than ICI/NVLink (only ``1/group`` of the bytes cross it);
``ReductionToOneDevice`` is mostly for debugging and tiny models (its root
device is a bottleneck); ``RING`` reproduces TF's ring for comparison.

How the reduction becomes explicit. With a non-default choice the strategy
runs the *same, unchanged* step once per replica (``jax.shard_map`` over the
replica axes) on its slice of the batch, and intercepts the point where
gradients meet the optimizer: every ``nnx.Optimizer`` passed to ``run`` gets,
for that trace only, an optax transformation in front of its own that reduces
the gradients (a mean over replicas, as the step's loss is a per-replica mean)
with the chosen algorithm — TensorFlow's ``apply_gradients`` does the same.
Consequences, all checked or documented:

- the step must update an ``nnx.Optimizer`` passed to ``run`` (a functional
  ``(params, opt_state, batch)`` step raises: its gradients never meet a
  point the strategy can intercept);
- its loss must be a mean over the batch (so that the mean of the replicas'
  gradients is the global gradient), as for TF's ``MirroredStrategy``;
- scalar outputs (losses, metrics) are averaged over replicas with the same
  algorithm; outputs with a batch dimension are concatenated;
- other state the step mutates (e.g. batch statistics) is kept from replica 0.

Options that cannot be honoured raise a :class:`CrossDeviceOpsError` naming why
(NCCL without GPUs, hierarchical groups that do not divide the devices...).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strategies.replica import replica_step
from strategies.replica.replica_step import CrossDeviceOpsError as CrossDeviceOpsError
from strategies.replica.watchdog import StepWatchdog as StepWatchdog

__all__ = [
    "AllReduceCrossDeviceOps",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "CrossDeviceOpsError",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "RingAllReduce",
    "StepWatchdog",
    "packs_for",
    "resolve",
]


class CommunicationImplementation(enum.Enum):
    """tf.distribute's collective implementations.

    ``AUTO``: XLA's all-reduce; ``RING``: an explicit ring of
    collective-permutes; ``NCCL``: XLA's all-reduce on GPUs (NCCL), refused on
    other platforms.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """Options for ``MultiWorkerMirroredStrategy(communication_options=...)`` (TF's names).

    Args:
        bytes_per_pack: ``0``: no explicit packing (XLA combines all gradients
            into one all-reduce); ``> 0``: gradients are concatenated into packs
            of at most this many bytes (a larger gradient is a pack of its own),
            each reduced by one collective, in order.
        timeout_seconds: a step whose collectives do not finish within this
            many seconds aborts the process with a message naming the step
            and exit status 76 (``dtensor.runtime.exit_codes.EXIT_STEP_TIMEOUT``;
            XLA cannot cancel a collective; without it a lost peer hangs).
        implementation: a :class:`CommunicationImplementation`.

    Examples:
        >>> import strategies
        >>> opts = strategies.CommunicationOptions(bytes_per_pack=1 << 20)
        >>> strategies.MultiWorkerMirroredStrategy(communication_options=opts).cross_device_ops
        AllReduceCrossDeviceOps(bytes_per_pack=1048576)
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise CrossDeviceOpsError(
                f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack!r}) is not valid; give "
                "0 (no packing) or a positive number of bytes, e.g. 4 << 20."
            )
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise CrossDeviceOpsError(
                f"CommunicationOptions(timeout_seconds={self.timeout_seconds!r}) is not valid; "
                "give a positive number of seconds, or None for no timeout."
            )
        impl = self.implementation
        if isinstance(impl, str):
            try:
                impl = CommunicationImplementation(impl.upper())
            except ValueError:
                raise CrossDeviceOpsError(
                    f"CommunicationOptions(implementation={self.implementation!r}) is not one of "
                    "AUTO, RING, NCCL; pass a strategies.CommunicationImplementation."
                ) from None
            object.__setattr__(self, "implementation", impl)

    def cross_device_ops(self) -> CrossDeviceOps | None:
        """The :class:`CrossDeviceOps` these options select (``None``: XLA's default)."""
        impl = self.implementation
        if impl is CommunicationImplementation.RING:
            return RingAllReduce(bytes_per_pack=self.bytes_per_pack)
        if impl is CommunicationImplementation.NCCL:
            return NcclAllReduce(bytes_per_pack=self.bytes_per_pack)
        if self.bytes_per_pack:
            return AllReduceCrossDeviceOps(bytes_per_pack=self.bytes_per_pack)
        return None


# ----------------------------------------------------------------- the ops
@dataclasses.dataclass(frozen=True)
class CrossDeviceOps:
    """The base of the gradient reductions. ``num_packs`` / ``bytes_per_pack`` set the packing."""

    num_packs: int = 1
    bytes_per_pack: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_packs, int) or self.num_packs < 1:
            raise CrossDeviceOpsError(
                f"{type(self).__name__}(num_packs={self.num_packs!r}) is not valid; give a "
                "positive number of packs (1: all gradients in one)."
            )
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise CrossDeviceOpsError(
                f"{type(self).__name__}(bytes_per_pack={self.bytes_per_pack!r}) is not valid; "
                "give 0 (packs set by num_packs) or a positive number of bytes."
            )
        if self.num_packs > 1 and self.bytes_per_pack:
            raise CrossDeviceOpsError(
                f"{type(self).__name__} got both num_packs={self.num_packs} and "
                f"bytes_per_pack={self.bytes_per_pack}; give one way of packing."
            )

    @property
    def is_default(self) -> bool:
        """Whether this is XLA's own all-reduce of the global step (nothing explicit)."""
        return False

    def check(self, mesh: Any, batch_axes: tuple[str, ...]) -> None:
        """Raise :class:`CrossDeviceOpsError` if this choice cannot run on ``mesh``."""

    # -- inside shard_map over the replica axes -------------------------------
    def all_mean(self, tree: Any, axes: tuple[str, ...]) -> Any:
        """The mean over the replicas of each leaf of ``tree`` (float leaves), packed."""
        leaves, treedef = jax.tree.flatten(tree)
        out = list(leaves)
        n = jax.lax.axis_size(axes) if axes else 1
        floats = [i for i, v in enumerate(leaves) if jnp.issubdtype(v.dtype, jnp.floating)]
        previous = None
        for pack in self._packs([leaves[i] for i in floats], floats):
            buf = jnp.concatenate([jnp.ravel(leaves[i]).astype(jnp.float32) for i in pack])
            if previous is not None:  # packs go in order: XLA must not merge them back
                buf, _ = jax.lax.optimization_barrier((buf, previous))
            reduced = self._reduce(buf, axes) / n
            previous = reduced
            offset = 0
            for i in pack:
                size = leaves[i].size
                out[i] = (
                    reduced[offset : offset + size].reshape(leaves[i].shape).astype(leaves[i].dtype)
                )
                offset += size
        return jax.tree.unflatten(treedef, out)

    def _packs(self, leaves: list[Any], index: list[int]) -> list[list[int]]:
        if not leaves:
            return []
        sizes = [v.size * 4 for v in leaves]
        if self.bytes_per_pack:
            packs: list[list[int]] = [[]]
            used = 0
            for i, b in zip(index, sizes, strict=True):
                if packs[-1] and used + b > self.bytes_per_pack:
                    packs.append([])
                    used = 0
                packs[-1].append(i)
                used += b
            return packs
        k = min(self.num_packs, len(leaves))
        target = sum(sizes) / k
        packs = [[]]
        used = 0
        for i, b in zip(index, sizes, strict=True):
            if packs[-1] and used + b / 2 > target * len(packs) and len(packs) < k:
                packs.append([])
            packs[-1].append(i)
            used += b
        return packs

    def _reduce(self, buf: Any, axes: tuple[str, ...]) -> Any:
        """The sum of ``buf`` over the replicas (every replica gets it)."""
        raise NotImplementedError

    # -- compiling a step (see strategies.replica.replica_step) --------------------------
    def wrap_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with the gradient reduction installed in front of its optimizers."""
        return replica_step.wrap_step(self, fn)

    def compile_step(
        self, strategy: Any, call: Callable[..., Any], arrays: list[Any], *, has_state: bool
    ) -> Any:
        """``call(state, arrays)`` once per replica, as one ``jax.jit`` (the strategy's hook)."""
        return replica_step.compile_step(self, strategy, call, arrays, has_state=has_state)

    def __repr__(self) -> str:
        fields = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return f"{type(self).__name__}({', '.join(fields)})"


@dataclasses.dataclass(frozen=True, repr=False)
class AllReduceCrossDeviceOps(CrossDeviceOps):
    """XLA's all-reduce. With one pack (the default) it is the default: nothing explicit.

    Examples:
        >>> import strategies
        >>> strategies.AllReduceCrossDeviceOps().is_default
        True
        >>> strategies.AllReduceCrossDeviceOps(num_packs=2).is_default
        False
    """

    @property
    def is_default(self) -> bool:
        return self.num_packs == 1 and not self.bytes_per_pack

    def _reduce(self, buf: Any, axes: tuple[str, ...]) -> Any:
        return jax.lax.psum(buf, axes)


@dataclasses.dataclass(frozen=True, repr=False)
class NcclAllReduce(AllReduceCrossDeviceOps):
    """TF's ``NcclAllReduce``: XLA's all-reduce on GPUs, where XLA runs it with NCCL.

    Refused on other platforms (NCCL is GPU-only): use
    :class:`AllReduceCrossDeviceOps` there, the same algorithm on that
    platform's own collectives.
    """

    def check(self, mesh: Any, batch_axes: tuple[str, ...]) -> None:
        if mesh.platform != "gpu":
            raise CrossDeviceOpsError(
                f"{self!r} needs GPUs: NCCL is NVIDIA's collective library, but this strategy's "
                f"devices are {mesh.platform!r}, whose collectives XLA runs without NCCL. Use "
                "strategies.AllReduceCrossDeviceOps() (XLA's all-reduce, NCCL on GPU) instead."
            )


@dataclasses.dataclass(frozen=True, repr=False)
class ReductionToOneDevice(CrossDeviceOps):
    """Sum every replica's gradients on one device, then send the result back.

    ``reduce_to_device``: the root, as its index among the replicas or a
    device of the mesh (default: the first replica).
    """

    reduce_to_device: Any = None

    def check(self, mesh: Any, batch_axes: tuple[str, ...]) -> None:
        self._root(mesh, batch_axes)

    def _root(self, mesh: Any, batch_axes: tuple[str, ...]) -> int:
        n = mesh.axis_size(batch_axes)
        root = self.reduce_to_device
        if root is None:
            return 0
        if isinstance(root, int) and 0 <= root < n:
            return root
        devices = [
            d
            for d in np.moveaxis(
                mesh.devices, [mesh.dim_names.index(a) for a in batch_axes], range(len(batch_axes))
            ).reshape(n, -1)[:, 0]
        ]
        if root in devices:
            return devices.index(root)
        raise CrossDeviceOpsError(
            f"ReductionToOneDevice(reduce_to_device={root!r}) is neither a replica index in "
            f"0..{n - 1} nor a device of the strategy's mesh {mesh!r}. Give one of those."
        )

    def _reduce(self, buf: Any, axes: tuple[str, ...]) -> Any:
        mesh = replica_step.bound_mesh()
        n = jax.lax.axis_size(axes)
        root = self._root(mesh, axes) if mesh is not None else 0
        total = buf
        for k in range(n):  # n-1 sends into the root; non-roots receive zeros
            if k != root:
                total = total + jax.lax.ppermute(buf, axes, [(k, root)])
        out = jnp.zeros_like(buf)
        for k in range(n):  # n-1 sends out of the root
            if k != root:
                out = out + jax.lax.ppermute(total, axes, [(root, k)])
        return jnp.where(jax.lax.axis_index(axes) == root, total, out)


@dataclasses.dataclass(frozen=True, repr=False)
class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Reduce within groups, then across groups, then broadcast within groups.

    Needs a two-level mesh: the strategy's replica axes ``(outer, inner)`` —
    ``("worker", "replica")`` for ``MultiWorkerMirroredStrategy`` (groups are
    hosts: ``inner`` is ICI/NVLink, ``outer`` DCN), ``("group", "replica")``
    for ``MirroredStrategy``, which splits its devices into ``num_groups``
    groups (TF's default: 2) in device order.
    """

    num_groups: int | None = None

    def check(self, mesh: Any, batch_axes: tuple[str, ...]) -> None:
        if len(batch_axes) != 2:
            raise CrossDeviceOpsError(
                f"{self!r} needs two replica axes (groups, devices in a group); this strategy "
                f"has {batch_axes} on {mesh!r}. Use MirroredStrategy or MultiWorkerMirroredStrategy."
            )
        if self.num_groups is not None and mesh.shape[batch_axes[0]] != self.num_groups:
            raise CrossDeviceOpsError(
                f"{self!r}: the strategy's groups are its {batch_axes[0]!r} axis, of size "
                f"{mesh.shape[batch_axes[0]]}, not {self.num_groups}. Leave num_groups=None there."
            )

    def _reduce(self, buf: Any, axes: tuple[str, ...]) -> Any:
        outer, inner = axes
        g = jax.lax.axis_size(inner)
        pad = (-buf.size) % g
        padded = jnp.pad(buf, (0, pad))
        piece = jax.lax.psum_scatter(padded, inner, scatter_dimension=0, tiled=True)
        piece = jax.lax.psum(piece, outer)
        full = jax.lax.all_gather(piece, inner, axis=0, tiled=True)
        return full[: buf.size]


@dataclasses.dataclass(frozen=True, repr=False)
class RingAllReduce(CrossDeviceOps):
    """A ring all-reduce of collective-permutes (``CommunicationImplementation.RING``)."""

    def _reduce(self, buf: Any, axes: tuple[str, ...]) -> Any:
        n = jax.lax.axis_size(axes)
        if n == 1:
            return buf
        pad = (-buf.size) % n
        chunks = jnp.pad(buf, (0, pad)).reshape(n, -1)
        me = jax.lax.axis_index(axes)
        ring = [(i, (i + 1) % n) for i in range(n)]
        for s in range(n - 1):  # reduce-scatter around the ring
            got = jax.lax.ppermute(chunks[(me - s) % n], axes, ring)
            chunks = chunks.at[(me - s - 1) % n].add(got)
        for s in range(n - 1):  # all-gather around the ring
            got = jax.lax.ppermute(chunks[(me + 1 - s) % n], axes, ring)
            chunks = chunks.at[(me - s) % n].set(got)
        return chunks.reshape(-1)[: buf.size]


def resolve(
    ops: Any, mesh: Any, batch_axes: tuple[str, ...], *, what: str
) -> CrossDeviceOps | None:
    """Check a user's ``cross_device_ops`` and return the explicit one (``None``: XLA's default)."""
    if ops is None:
        return None
    if not isinstance(ops, CrossDeviceOps):
        raise CrossDeviceOpsError(
            f"{what}(cross_device_ops={ops!r}) is not a cross-device ops object; give "
            "strategies.AllReduceCrossDeviceOps(), NcclAllReduce(), ReductionToOneDevice() or "
            "HierarchicalCopyAllReduce() (TensorFlow's objects are not accepted)."
        )
    ops.check(mesh, batch_axes)
    return None if ops.is_default else ops


def packs_for(ops: CrossDeviceOps, shapes: Sequence[tuple[int, ...]]) -> list[int]:
    """The bytes of each pack ``ops`` makes of float32 gradients of these shapes (for reports)."""
    leaves = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return [
        sum(math.prod(shapes[i]) * 4 for i in p)
        for p in ops._packs(leaves, list(range(len(leaves))))
    ]
