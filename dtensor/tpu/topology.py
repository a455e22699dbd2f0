"""TPU topologies without a TPU: real device objects for ahead-of-time compiles.

With ``libtpu`` installed (``pip install "jax[tpu]"`` brings the matching
one), :func:`tpu_topology` returns the devices of any Cloud TPU topology, on
any machine, even with ``JAX_PLATFORMS=cpu``: they carry ``coords``,
``core_on_chip``, ``process_index`` and (for several slices)
``slice_index``, and ``jax.jit(...).lower(abstract args).compile()`` over a
mesh of them runs the real TPU compiler. Pass them as ``devices=`` to
:func:`dtensor.create_mesh`, :func:`dtensor.create_distributed_mesh` or any
preset, then ask :func:`dtensor.explain` (or ``strategy.explain``) what the
step costs per chip.

How much memory a step needs per chip is :mod:`dtensor.analysis.memory`'s
question.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import jax.errors

from dtensor.tpu.slices import EXAMPLES as _EXAMPLES
from dtensor.tpu.slices import SliceError, TpuSlice, describe_slice

__all__ = ["TopologyError", "tpu_slice", "tpu_topology"]


class TopologyError(ValueError):
    """A TPU topology that libtpu cannot describe."""


@contextlib.contextmanager
def _quiet_libtpu() -> Iterator[None]:
    """Tell libtpu there is no TPU VM to query (else it prints errors on first use).

    Only where no TPU is attached, and only while the plugin starts; the
    topology it then describes is the same either way.
    """
    attached = any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))
    quiet = {
        # No TPU to guard: let several processes (pytest-xdist workers) load libtpu.
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v5litepod-16",
        "TPU_WORKER_HOSTNAMES": "localhost",
    }
    added = [] if attached else [k for k in quiet if k not in os.environ]
    for k in added:
        os.environ[k] = quiet[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@functools.lru_cache(maxsize=64)
def _topology(piece: TpuSlice, num_slices: int) -> tuple[Any, ...]:
    from jax.experimental import topologies

    name = piece.grid_name
    try:
        with _quiet_libtpu():
            desc = topologies.get_topology_desc(
                platform="tpu",
                topology_name=name,
                num_slices=num_slices,
                chip_config_name=piece.chip_config,
                chips_per_host_bounds=piece.chips_per_host,
                wrap=piece.wrap,
            )
    except RuntimeError as e:
        if "lockfile" in str(e):
            raise RuntimeError(
                f"tpu_topology({name!r}): libtpu is in use by another process ({e}). Set "
                "ALLOW_MULTIPLE_LIBTPU_LOAD=1 in the environment of every process that compiles "
                "for TPU topologies (dtensor sets it itself where no TPU is attached)."
            ) from None
        if isinstance(e, jax.errors.JaxRuntimeError):
            detail = str(e).removeprefix("INVALID_ARGUMENT: ")
            raise TopologyError(
                f"tpu_topology({name!r}, num_slices={num_slices}) is not a topology libtpu "
                f"can describe ({detail}). Name Cloud TPU's accelerator type or a generation "
                f"and its chip grid, e.g. {_EXAMPLES} (v4/v5p/tpu7x grids are 3-D, v5e/v6e 2-D)."
            ) from None
        raise RuntimeError(
            f"tpu_topology({name!r}) needs libtpu, which is not installed ({e}). Install the "
            "one matching jax: pip install 'jax[tpu]==<your jax version>' (for jax 0.10.2: "
            "pip install 'libtpu==0.0.42.*'), or pip install -e '.[dev]' in this project."
        ) from None
    return tuple(desc.devices)


def tpu_slice(name: str, *, wrap: object = None) -> TpuSlice:
    """The slice Cloud TPU builds for ``name`` (see :mod:`dtensor.tpu.slices`).

    Raises:
        TopologyError: a name Cloud TPU does not build, or a bad ``wrap``.

    Examples:
        >>> from dtensor.tpu.topology import tpu_slice
        >>> s = tpu_slice("v5p-1024")
        >>> s.grid_name, s.chips, s.wrap
        ('v5p:8x8x8', 512, (True, True, True))
    """
    try:
        return describe_slice(name, wrap=wrap)
    except SliceError as e:
        raise TopologyError(str(e)) from None


def tpu_topology(name: str, *, num_slices: int = 1, wrap: object = None) -> list[Any]:
    """The devices of a Cloud TPU slice as Cloud TPU builds it, from libtpu's compiler.

    No TPU is needed. Use them as ``devices=`` anywhere
    (:func:`dtensor.create_mesh`, :func:`dtensor.create_distributed_mesh`,
    every preset) to compile for that slice ahead of time; they cannot run
    anything. Calls with the same arguments return the same device objects.

    The slice is described as a user rents it (:mod:`dtensor.tpu.slices`):
    wraparound (torus) links where Cloud TPU has them (v4/v5p slices whose
    every side is a multiple of 4, v5p-128 and up; the 16-chip sides of
    v5e/v6e 8x16 and 16x16 slices), one device a chip (megacore) on v4/v5p
    (two on tpu7x, whose TensorCores are separate devices),
    2x2x1 chips a host. The links change the program: without them libtpu
    turns a gather over a 64-chip axis into an all-reduce of a zero-padded
    buffer.

    Args:
        name: Cloud TPU's accelerator type, the name ``gcloud`` takes
            (``"v5p-128"``, ``"v5litepod-16"`` or ``"v5e-16"``, ``"v6e-256"``,
            ``"v4-128"``; v4/v5p numbers count TensorCores, 2 a chip), or a
            generation and chip grid (``"v5p:4x4x4"``, ``"v5e:4x4"``,
            ``"v4:4x4x8_twisted"``).
        num_slices: how many such slices, joined by DCN (multislice); the
            devices then carry ``slice_index``.
        wrap: override the torus links (a bool, or one per dimension) for a
            reservation that differs from Cloud TPU's standard slice.

    Returns:
        The devices, slice by slice, each slice host by host.

    Raises:
        TopologyError: a name or slice count libtpu does not accept.
        RuntimeError: libtpu is not installed.

    Examples:
        >>> import dtensor
        >>> devices = dtensor.tpu_topology("v5e:4x4", num_slices=2)
        >>> len(devices), devices[0].platform, devices[0].device_kind
        (32, 'tpu', 'TPU v5 lite')
        >>> sorted({d.slice_index for d in devices})
        [0, 1]
        >>> dtensor.create_mesh([("data", 2), ("model", 16)], devices=devices)
        Mesh(data=2, model=16)
        >>> len(dtensor.tpu_topology("v5p-128"))   # 64 chips: a 4x4x4 torus
        64
    """
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
        raise TopologyError(
            f"tpu_topology({name!r}, num_slices={num_slices!r}): num_slices must be a positive "
            "integer (1 for one slice, 2+ for multislice over DCN)."
        )
    return list(_topology(tpu_slice(name, wrap=wrap), num_slices))
