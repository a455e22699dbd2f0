"""The one place dtensor and strategies touch JAX's private modules (``jax._src``).

Each function here reads something JAX has no public API for, and falls back
to a public (if weaker) answer when JAX's internals move: an upgrade of JAX
then degrades one feature, named here, instead of breaking an import. Every
function has a test of both paths (``tests/test_compat.py``, ``tests/test_compat_cluster.py``). Code
elsewhere imports these functions, never ``jax._src``.

Public APIs replace private ones wherever they exist: XLA's runtime error is
``jax.errors.JaxRuntimeError`` (not ``jax._src.lib._jax``), the current mesh is
``jax.sharding.get_mesh()`` / ``get_abstract_mesh()``.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

__all__ = [
    "backends_initialized",
    "cluster_types",
    "coordinator_address",
    "detected_cluster",
    "distributed_client",
    "distributed_timeouts",
    "preemption_sync_manager",
    "use_gloo_address",
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


def distributed_shutdown(settle_s: float = 1.0) -> None:
    """``jax.distributed.shutdown()``, the coordination service (process 0's) ``settle_s`` later.

    JAX shuts this process's client down (the shutdown barrier every process
    passes) and then, in the process that holds it, the service at once; a
    call another process's client still has in flight for a moment after the
    barrier then meets a gRPC server being destroyed, which aborts process 0
    (``Check failed: queue.Pop() == nullptr`` in ``RealRequestMatcher``, seen
    under load after a job's work was done). Here the service goes after the
    others have had ``settle_s`` to leave.

    Examples:
        >>> from dtensor.compat import distributed_shutdown
        >>> distributed_shutdown()  # one process: nothing to leave
    """
    import time

    from jax._src import distributed

    state = distributed.global_state
    service = getattr(state, "service", None)
    if service is None:
        jax.distributed.shutdown()
        return
    state.service = None
    try:
        jax.distributed.shutdown()  # the preemption manager, then this process's client
    finally:
        time.sleep(settle_s)
        service.shutdown()


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


def cluster_types() -> tuple[type, ...]:
    """The cluster environments JAX's ``jax.distributed.initialize()`` detects, in its order.

    Private: ``jax._src.clusters.ClusterEnv._cluster_types`` (importing
    ``jax._src.clusters`` registers them). Fallback when that moves: ``()``,
    so dtensor recognises no JAX-detected cluster by name, and
    ``jax.distributed.initialize()`` still detects it itself when called
    without arguments.

    Examples:
        >>> from dtensor.compat import cluster_types
        >>> any(t.__name__ == "SlurmCluster" for t in cluster_types())
        True
    """
    try:
        from jax._src import clusters
    except ImportError:
        return ()
    registered = getattr(getattr(clusters, "ClusterEnv", None), "_cluster_types", None)
    if not isinstance(registered, list | tuple):
        return ()
    return tuple(t for t in registered if isinstance(t, type))


def detected_cluster(types: tuple[type, ...] | None = None) -> str | None:
    """The name of the cluster environment JAX's detection would use here, or ``None``.

    Environments that JAX only uses when asked for by name
    (``opt_in_only_method``) are skipped, as ``jax.distributed.initialize``
    skips them; a detector that cannot run here (it raises) is not this
    process's cluster.

    Args:
        types: the environments to try (default :func:`cluster_types`).

    Examples:
        >>> from dtensor.compat import detected_cluster
        >>> class Here:
        ...     @staticmethod
        ...     def is_env_present():
        ...         return True
        >>> detected_cluster((Here,))
        'Here'
    """
    for env in cluster_types() if types is None else types:
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            present = bool(env.is_env_present())  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - a third-party detector may fail in any way
            continue
        if present:
            return env.__name__
    return None


def preemption_sync_manager() -> Any | None:
    """JAX's preemption sync manager (multi-process runs over the coordination service), or ``None``.

    Private: ``jax._src.distributed.global_state.preemption_sync_manager``.
    Fallback when that moves: ``None``, so preemption notices are not shared
    between processes (each process still sees its own signal).

    Examples:
        >>> from dtensor.compat import preemption_sync_manager
        >>> preemption_sync_manager() is None  # a single process
        True
    """
    try:
        from jax._src import distributed
    except ImportError:
        return None
    state = getattr(distributed, "global_state", None)
    return getattr(state, "preemption_sync_manager", None)


def distributed_timeouts(**timeouts: int) -> dict[str, Any]:
    """The timeout keyword arguments of ``jax.distributed.initialize``, among ``timeouts``, this JAX takes.

    Not private, but version-specific: ``heartbeat_timeout_seconds`` and
    ``shutdown_timeout_seconds`` are in JAX 0.10's signature; a name this
    JAX's signature lacks is left out (with a warning saying JAX's own default
    applies instead, e.g. a 100 s heartbeat: then dtensor's peer monitor still
    decides first, as it must).

    Examples:
        >>> from dtensor.compat import distributed_timeouts
        >>> distributed_timeouts(heartbeat_timeout_seconds=80)
        {'heartbeat_timeout_seconds': 80}
    """
    import inspect

    try:
        parameters = inspect.signature(jax.distributed.initialize).parameters
    except (TypeError, ValueError):  # no signature to read: pass what JAX 0.10 takes
        return dict(timeouts)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(timeouts)  # a wrapper taking **kwargs passes them on
    accepted = set(parameters)
    dropped = sorted(set(timeouts) - accepted)
    if dropped:
        warnings.warn(
            f"jax.distributed.initialize in JAX {jax.__version__} takes no {', '.join(dropped)}; "
            "JAX's own default applies for it instead.",
            stacklevel=2,
        )
    return {k: v for k, v in timeouts.items() if k in accepted}


def use_gloo_address(hostname: str) -> bool:
    """Make the CPU backend's gloo collectives bind and advertise ``hostname`` (an address).

    JAX creates gloo's TCP collectives without a host name or interface, so
    gloo advertises what this host's own name resolves to: ``127.0.1.1`` on
    Debian and Ubuntu, which no other host reaches ("Gloo context
    initialization failed: ... Connection refused, remote=[127.0.1.1]").
    jaxlib's ``make_gloo_tcp_collectives(distributed_client, hostname=...,
    interface=...)`` takes one; this registers, through the public
    ``jax.extend.backend.register_backend_factory``, a CPU backend factory
    that passes it. Call it before JAX starts its backends.

    Private: ``jax._src.xla_bridge.make_cpu_client``,
    ``jax._src.distributed.global_state`` and ``jaxlib``'s
    ``make_gloo_tcp_collectives``. Fallback when they move: ``False``, with a
    warning; gloo then keeps JAX's own choice (this host's name).

    Examples:
        >>> from dtensor.compat import use_gloo_address
        >>> use_gloo_address("127.0.0.1")  # the backends already run here: too late
        False
    """
    if backends_initialized():
        return False
    try:
        from jax._src import distributed, xla_bridge
        from jax._src.lib import _jax

        make_gloo = _jax.make_gloo_tcp_collectives
        make_cpu_client = xla_bridge.make_cpu_client
        state = distributed.global_state
    except (ImportError, AttributeError) as e:
        warnings.warn(
            f"dtensor could not pass the address {hostname} to gloo's CPU collectives ({e}); "
            "gloo advertises what this host's name resolves to, which other hosts may not "
            "reach. Make the host name resolve to an address the other hosts reach.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False

    def make_client() -> Any:
        collectives = None
        impl = getattr(jax.config, "jax_cpu_collectives_implementation", None)
        if state.client is not None and impl == "gloo":
            collectives = make_gloo(distributed_client=state.client, hostname=hostname)
        return make_cpu_client(collectives=collectives)

    from jax.extend import backend

    backend.register_backend_factory("cpu", make_client, priority=0, fail_quietly=False)
    return True
