"""Finding the cluster: launcher variables, JAX's detection, or a ``TF_CONFIG``.

:func:`resolve_cluster` is a pure function of the environment (and of
:func:`parse_tf_config` for TensorFlow users' cluster JSON); the runtime
(:mod:`dtensor.runtime`) connects to what it returns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from dtensor.runtime.exit_codes import EXIT_PEER_LOST as EXIT_PEER_LOST

ENV_COORDINATOR = "DTENSOR_COORDINATOR"
ENV_NUM_PROCESSES = "DTENSOR_NUM_PROCESSES"
ENV_PROCESS_ID = "DTENSOR_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "DTENSOR_DEVICES_PER_PROCESS"
ENV_STATUS_DIR = "DTENSOR_LAUNCH_STATUS_DIR"
"""Where :mod:`dtensor.launch` writes each ended process's status (read by the runtime)."""

LAUNCHER_SOURCE = "dtensor.launch"


class ClusterConfigError(ValueError):
    """A cluster description (arguments, launcher variables, ``TF_CONFIG``) that is not valid."""


class DistributedRuntimeError(RuntimeError):
    """The multi-process runtime could not start, or lost a process."""


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Where this process sits in a multi-process job.

    Attributes:
        coordinator_address: ``host:port`` of process 0's coordination service
            (``None`` when JAX's own cluster detection will find it).
        num_processes: the number of processes (``None``: JAX detects it).
        process_id: this process's index (``None``: JAX detects it).
        source: where the description came from (``"arguments"``,
            ``"dtensor.launch"``, ``"TF_CONFIG"``, ``"jax:SlurmCluster"``...).
        local_device_count: CPU devices this process should simulate, if asked.

    Examples:
        >>> from dtensor.runtime.cluster import parse_tf_config
        >>> parse_tf_config('{"cluster": {"worker": ["a:1", "b:2"]}, '
        ...                 '"task": {"type": "worker", "index": 1}}')
        ClusterSpec(coordinator_address='a:1', num_processes=2, process_id=1, source='TF_CONFIG', local_device_count=None)
    """

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    source: str
    local_device_count: int | None = None


# ---------------------------------------------------------------- resolution
def _tf_error(what: str, got: Any) -> ClusterConfigError:
    return ClusterConfigError(
        f"TF_CONFIG {what}; got {got!r}. A valid TF_CONFIG looks like "
        '{"cluster": {"worker": ["host0:port", "host1:port"]}, "task": {"type": "worker", '
        '"index": 0}} (an optional "chief" list of one address counts as process 0). '
        "Fix the variable, or unset it and pass coordinator_address/num_processes/process_id."
    )


def parse_tf_config(tf_config: str | Mapping[str, Any]) -> ClusterSpec:
    """Read a TensorFlow ``TF_CONFIG`` cluster description.

    The processes are the ``chief`` (if present, process 0) followed by the
    ``worker`` list in order; the coordinator is process 0's address. Other
    task types (``ps``, ``evaluator``) are not part of a dtensor job.

    Args:
        tf_config: the JSON text, or the already-parsed mapping.

    Returns:
        The cluster, with ``source="TF_CONFIG"``.

    Raises:
        ClusterConfigError: the JSON is malformed, lacks ``cluster`` or
            ``task``, has an index out of range, or names a task type that is
            not a worker.

    Examples:
        >>> from dtensor.runtime.cluster import parse_tf_config
        >>> spec = parse_tf_config({"cluster": {"chief": ["c:7"], "worker": ["w0:7", "w1:7"]},
        ...                         "task": {"type": "worker", "index": 0}})
        >>> spec.coordinator_address, spec.num_processes, spec.process_id
        ('c:7', 3, 1)
    """
    if isinstance(tf_config, str):
        try:
            config = json.loads(tf_config)
        except json.JSONDecodeError as e:
            raise _tf_error(
                f"is not valid JSON ({e.msg} at character {e.pos})", tf_config
            ) from None
    else:
        config = tf_config
    if not isinstance(config, Mapping):
        raise _tf_error("is not a JSON object", config)
    if "cluster" not in config:
        raise _tf_error("has no 'cluster' entry", dict(config))
    cluster = config["cluster"]
    if not isinstance(cluster, Mapping):
        raise _tf_error("'cluster' is not an object of task type -> address list", cluster)
    chief = cluster.get("chief", [])
    workers = cluster.get("worker", [])
    for name, addresses in (("chief", chief), ("worker", workers)):
        if not isinstance(addresses, list | tuple) or not all(
            isinstance(a, str) and ":" in a for a in addresses
        ):
            raise _tf_error(f"'cluster.{name}' is not a list of 'host:port' strings", addresses)
    if len(chief) > 1:
        raise _tf_error("'cluster.chief' lists more than one address", chief)
    processes = list(chief) + list(workers)
    if not processes:
        raise _tf_error("'cluster' has neither a 'worker' nor a 'chief' list", dict(cluster))
    task = config.get("task")
    if not isinstance(task, Mapping):
        raise _tf_error("has no 'task' object saying which process this is", task)
    task_type, index = task.get("type"), task.get("index", 0)
    if task_type not in ("worker", "chief"):
        raise _tf_error(
            f"task type {task_type!r} is not a worker: dtensor runs 'worker' (and 'chief') "
            "tasks only",
            dict(task),
        )
    if isinstance(index, bool) or not isinstance(index, int):
        raise _tf_error("'task.index' is not an integer", index)
    members = chief if task_type == "chief" else workers
    if not 0 <= index < len(members):
        raise _tf_error(
            f"task index {index} is out of range for the {len(members)} "
            f"'{task_type}' address(es) in 'cluster'",
            dict(task),
        )
    process_id = index if task_type == "chief" else len(chief) + index
    return ClusterSpec(processes[0], len(processes), process_id, "TF_CONFIG")


def int_env(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ClusterConfigError(
            f"environment variable {name}={value!r} is not an integer, but {ENV_COORDINATOR} is "
            f"set, so dtensor expects the full set {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, "
            f"{ENV_PROCESS_ID} (as python -m dtensor.launch sets them). Set it to an integer, "
            f"or unset {ENV_COORDINATOR}."
        ) from None


def _jax_cluster() -> str | None:
    """The name of the cluster environment JAX's own detection would use, if any."""
    from dtensor import compat

    return compat.detected_cluster()


def resolve_cluster(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ClusterSpec | None:
    """Find this process's cluster, or ``None`` for a single process.

    Order: explicit arguments (all three), the :mod:`dtensor.launch`
    variables, JAX's cluster detection (then only the environment's name is
    recorded; JAX reads the rest), then ``TF_CONFIG``.

    Args:
        coordinator_address: ``host:port`` of process 0.
        num_processes: the number of processes.
        process_id: this process's index.
        environ: the environment to read (default ``os.environ``).

    Returns:
        The cluster, or ``None`` when nothing describes one.

    Raises:
        ClusterConfigError: a partial or inconsistent description.

    Examples:
        >>> from dtensor.runtime.cluster import resolve_cluster
        >>> resolve_cluster(environ={}) is None
        True
        >>> resolve_cluster(environ={"DTENSOR_COORDINATOR": "127.0.0.1:1234",
        ...     "DTENSOR_NUM_PROCESSES": "2", "DTENSOR_PROCESS_ID": "1"}).process_id
        1
    """
    env = os.environ if environ is None else environ
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ClusterConfigError(
                f"initialize() got only some of coordinator_address, num_processes, process_id "
                f"({', '.join(missing)} missing); got {given}. Pass all three, or none to "
                "read them from the environment (dtensor.launch, SLURM, TPU VMs, TF_CONFIG)."
            )
        spec = ClusterSpec(coordinator_address, num_processes, process_id, "arguments")
    elif env.get(ENV_COORDINATOR):
        spec = ClusterSpec(
            env[ENV_COORDINATOR],
            int_env(env, ENV_NUM_PROCESSES),
            int_env(env, ENV_PROCESS_ID),
            LAUNCHER_SOURCE,
        )
    elif environ is None and (name := _jax_cluster()) is not None:
        return ClusterSpec(None, None, None, f"jax:{name}")
    elif env.get("TF_CONFIG"):
        spec = parse_tf_config(env["TF_CONFIG"])
    else:
        return None
    _check_spec(spec)
    return spec


def _check_spec(spec: ClusterSpec) -> None:
    n, i, addr = spec.num_processes, spec.process_id, spec.coordinator_address
    if not isinstance(n, int) or n < 1:
        raise ClusterConfigError(
            f"num_processes (from {spec.source}) is {n!r}; it must be an integer >= 1."
        )
    if not isinstance(i, int) or not 0 <= i < n:
        raise ClusterConfigError(
            f"process_id (from {spec.source}) is {i!r}, but with num_processes={n} the valid "
            f"ids are 0..{n - 1}. Give each process its own id in that range."
        )
    if not isinstance(addr, str) or not re.fullmatch(r".+:\d+", addr):
        raise ClusterConfigError(
            f"coordinator_address (from {spec.source}) is {addr!r}; it must be 'host:port', "
            "e.g. '10.0.0.1:1234' (process 0's host and a free port)."
        )
