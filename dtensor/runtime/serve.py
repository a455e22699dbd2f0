"""``serve()``: what the ``ps`` and ``worker`` tasks of a parameter-server job do (TF's ``server.join()``).

The runtime knows the roles and the transport (:mod:`dtensor.runtime.rpc`);
what a role *does* with a request is registered by the layer that knows it
(``strategies`` registers the parameter server and the worker of
``ClusterCoordinator``) with :func:`register_service`. A service is an object
with ``lanes`` (how many ordered conversations it answers at once) and
``handle(message) -> reply``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from dtensor import compat
from dtensor.runtime import rpc
from dtensor.runtime.process import peer_monitor
from dtensor.runtime.roles import TaskRole, current_role

__all__ = ["Server", "Service", "register_service", "registered_services", "serve"]


class Service(Protocol):
    lanes: int

    def handle(self, message: dict[str, Any]) -> dict[str, Any]: ...


_services: dict[str, Callable[[TaskRole, Any, rpc.Transfers], Service]] = {}


def register_service(
    task_type: str, factory: Callable[[TaskRole, Any, rpc.Transfers], Service]
) -> None:
    """Say what ``serve()`` runs for ``task_type`` (``factory(role, client, transfers)``).

    Examples:
        >>> import strategies  # registers the parameter server and the worker
        >>> from dtensor.runtime.serve import registered_services
        >>> registered_services()
        ['ps', 'worker']
    """
    _services[task_type] = factory


def registered_services() -> list[str]:
    """The task types :func:`serve` knows what to do for."""
    return sorted(_services)


class Server:
    """TF's spelling: ``tf.distribute.Server(...).join()`` is ``Server().join()`` here.

    Examples:
        >>> from dtensor.runtime.serve import Server
        >>> Server().join()  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        RuntimeError: serve() outside a parameter-server job ...
    """

    def join(self) -> None:
        """Serve this task's role until the chief ends the job (see :func:`serve`)."""
        serve()


def _guarded(service: Service) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def handle(message: dict[str, Any]) -> dict[str, Any]:
        try:
            return service.handle(message)
        except rpc.PeerGone as e:
            return {"error": str(e), "kind": "peer"}
        except Exception as e:  # noqa: BLE001 - the chief re-raises it as the closure's error
            return {
                "error": f"{type(e).__name__}: {e}",
                "kind": "user",
                "traceback": traceback.format_exc(limit=8),
            }

    return handle


def serve() -> None:
    """Serve this task's role until the chief ends the job (TF: ``server.join()``).

    Call it on every task but the chief, after :func:`dtensor.runtime.join_cluster`
    and after the script's top level has registered its step, dataset and
    builder functions. Like TF's ``server.join()`` it does not return: when
    the chief's coordinator closes, the task ends with status 0.

    Raises:
        RuntimeError: not in a parameter-server job, called on the chief, or no
            service registered for the role (``import strategies`` first).

    Examples:
        >>> import dtensor.runtime
        >>> dtensor.runtime.serve()  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        RuntimeError: serve() outside a parameter-server job ...
    """
    role = current_role()
    if role is None:
        raise RuntimeError(
            "serve() outside a parameter-server job: this process has no role. Call "
            "dtensor.runtime.join_cluster() first (under python -m dtensor.launch --ps N "
            "--workers M, or with a TF_CONFIG that lists chief, ps and worker tasks)."
        )
    if role.is_chief:
        raise RuntimeError(
            "serve() on the chief: the chief runs the training loop with "
            "strategies.ClusterCoordinator; only 'ps' and 'worker' tasks serve."
        )
    factory = _services.get(role.task_type)
    if factory is None:
        raise RuntimeError(
            f"serve() on a '{role.task_type}' task: no service is registered for it; got "
            f"{sorted(_services)}. Import strategies (which registers the parameter server and "
            "the worker of ClusterCoordinator) before calling serve()."
        )
    client = compat.distributed_client()
    assert client is not None  # join_cluster() joined the job
    transfers = rpc.Transfers()
    rpc.announce(role, transfers.address())
    service = factory(role, client, transfers)
    info = rpc.TaskInfo(role.process_id, rpc.new_incarnation(), transfers.address())
    stop = threading.Event()
    handle = _guarded(service)
    threads = [
        threading.Thread(
            target=rpc.serve_lane,
            args=(client, info, lane, handle, stop),
            name=f"dtensor-serve-{lane}",
            daemon=True,
        )
        for lane in range(service.lanes)
    ]
    for t in threads:
        t.start()
    info.publish(client)
    while True:
        try:
            client.blocking_key_value_get(rpc.STOP_KEY, 1000)
            break
        except Exception as e:  # noqa: BLE001 - a timeout: keep serving
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
    stop.set()
    for t in threads:
        t.join(timeout=5)
    end_task(0)


def end_task(status: int = 0) -> None:
    """End a serving task now (TF's ``server.join()`` never returns).

    It tells the others it finished (the chief waits for that before it
    stops the coordination service) and exits at once, without JAX's
    shutdown RPC: a recoverable task still disconnecting when the chief shuts
    the service down would otherwise abort.
    """
    monitor = peer_monitor()
    if monitor is not None:
        monitor.finish(0)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def stop_services(client: Any) -> None:
    """The chief: tell every serving task to return from :func:`serve`."""
    client.key_value_set(rpc.STOP_KEY, json.dumps(True), allow_overwrite=True)
