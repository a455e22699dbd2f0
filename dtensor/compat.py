"""The few private JAX internals dtensor relies on, each behind one function.

JAX keeps ``jax._src`` private behind short re-export modules; this module is
dtensor's equivalent in the other direction: every use of a private JAX name by
the runtime goes through here, with a public fallback where one exists, so a
JAX upgrade that moves them breaks one file, loudly, not the runtime.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = [
    "backends_initialized",
    "coordinator_address",
    "detected_cluster",
    "distributed_client",
]


def distributed_client() -> Any | None:
    """JAX's coordination-service client of this process (key-value store, barriers), or ``None``.

    ``None`` when the process has not joined a multi-process job
    (``jax.distributed.is_initialized()`` is the public test for that).

    Examples:
        >>> from dtensor.compat import distributed_client
        >>> distributed_client() is None  # one process: no job joined
        True
    """
    if not jax.distributed.is_initialized():
        return None
    from jax._src import distributed

    return distributed.global_state.client


def coordinator_address() -> str | None:
    """The ``host:port`` of the job's coordination service, as JAX resolved it (``None``: no job).

    Examples:
        >>> from dtensor.compat import coordinator_address
        >>> coordinator_address() is None
        True
    """
    if not jax.distributed.is_initialized():
        return None
    from jax._src import distributed

    address = getattr(distributed.global_state, "coordinator_address", None)
    return None if address is None else str(address)


def backends_initialized() -> bool:
    """Whether JAX already started its backends (after which ``jax.distributed`` cannot join).

    Examples:
        >>> import jax
        >>> from dtensor.compat import backends_initialized
        >>> _ = jax.devices()
        >>> backends_initialized()
        True
    """
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - JAX moved it; assume the worst
        return True
    return bool(xla_bridge.backends_are_initialized())


def detected_cluster() -> str | None:
    """The name of the cluster environment JAX's own detection would use here (SLURM, TPU VM...).

    ``None`` when none is present (JAX has no public way to ask without joining).

    Examples:
        >>> from dtensor.compat import detected_cluster
        >>> detected_cluster() in (None, "SlurmCluster", "GceTpuCluster", "OmpiCluster")
        True
    """
    try:
        from jax._src import clusters  # noqa: F401  (registers the environments)
        from jax._src.clusters import ClusterEnv
    except ImportError:  # pragma: no cover - JAX moved it: no detection, say so by None
        return None
    for env in ClusterEnv._cluster_types:
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            if env.is_env_present():
                return env.__name__
        except Exception:  # a detector that cannot run here is not our cluster
            continue
    return None
