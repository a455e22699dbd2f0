"""Roles of a parameter-server job, as TensorFlow names them: one ``chief``, ``ps`` and ``worker`` tasks.

Every task runs the same script. :func:`join_cluster` finds this process's
role and joins the job (``jax.distributed`` with JAX's recoverable tasks, so a
worker may die and come back without ending the others); the chief then
trains with ``strategies.ClusterCoordinator``, the others call
:func:`dtensor.runtime.serve`. Processes are numbered chief first (process 0,
which runs the coordination service), then the ``ps`` tasks, then the workers.

Where the roles come from, in order:

- arguments ``task_type``/``task_index`` with ``num_ps``/``num_workers``;
- :mod:`dtensor.launch` ``--ps N --workers M`` (``DTENSOR_TASK_TYPE``,
  ``DTENSOR_TASK_INDEX``, ``DTENSOR_NUM_PS``, ``DTENSOR_NUM_WORKERS``);
- a ``TF_CONFIG`` with ``chief``, ``ps`` and ``worker`` lists (the chief's
  address is the coordinator's);
- JAX's own cluster detection plus ``num_ps`` (the process index gives the
  role in the order above).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from dtensor.runtime.cluster import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ClusterConfigError,
    int_env,
)

__all__ = ["TASK_TYPES", "TaskRole", "current_role", "join_cluster", "resolve_role"]

ENV_TASK_TYPE = "DTENSOR_TASK_TYPE"
ENV_TASK_INDEX = "DTENSOR_TASK_INDEX"
ENV_NUM_PS = "DTENSOR_NUM_PS"
ENV_NUM_WORKERS = "DTENSOR_NUM_WORKERS"
TASK_TYPES = ("chief", "ps", "worker")

_current: list[TaskRole] = []


@dataclasses.dataclass(frozen=True, slots=True)
class TaskRole:
    """This process's task in a parameter-server job (TF's ``task_type``/``task_index``).

    Attributes:
        task_type: ``"chief"``, ``"ps"`` or ``"worker"``.
        task_index: its index among the tasks of that type.
        num_ps: how many ``ps`` tasks the job has.
        num_workers: how many ``worker`` tasks.

    Examples:
        >>> from dtensor.runtime.roles import TaskRole
        >>> role = TaskRole("worker", 1, num_ps=1, num_workers=2)
        >>> role.process_id, role.num_processes, role.name_of(1)
        (3, 4, 'ps 0')
    """

    task_type: str
    task_index: int
    num_ps: int
    num_workers: int

    def __post_init__(self) -> None:
        if self.task_type not in TASK_TYPES:
            raise ClusterConfigError(
                f"task_type={self.task_type!r} is not a parameter-server role; use one of "
                f"{TASK_TYPES}."
            )
        if self.num_ps < 1 or self.num_workers < 1:
            raise ClusterConfigError(
                f"a parameter-server job needs at least one ps and one worker; got "
                f"num_ps={self.num_ps}, num_workers={self.num_workers}. Start it with e.g. "
                "python -m dtensor.launch --ps 1 --workers 2 -- python train.py."
            )
        count = {"chief": 1, "ps": self.num_ps, "worker": self.num_workers}[self.task_type]
        if not 0 <= self.task_index < count:
            raise ClusterConfigError(
                f"task_index={self.task_index} is out of range for the {count} "
                f"'{self.task_type}' task(s); use 0..{count - 1}."
            )

    @property
    def num_processes(self) -> int:
        """Chief + ps + workers."""
        return 1 + self.num_ps + self.num_workers

    @property
    def process_id(self) -> int:
        """This task's process index (chief 0, then ps, then workers)."""
        return self.process_of(self.task_type, self.task_index)

    def process_of(self, task_type: str, index: int) -> int:
        """The process index of task ``index`` of ``task_type``."""
        return {"chief": 0, "ps": 1, "worker": 1 + self.num_ps}[task_type] + index

    def task_of(self, process_id: int) -> tuple[str, int]:
        """``(task_type, task_index)`` of a process index."""
        if process_id == 0:
            return "chief", 0
        if process_id <= self.num_ps:
            return "ps", process_id - 1
        return "worker", process_id - 1 - self.num_ps

    def name_of(self, process_id: int) -> str:
        """``"ps 0"``, ``"worker 1"``, ``"chief"``: how messages name a process."""
        kind, index = self.task_of(process_id)
        return "chief" if kind == "chief" else f"{kind} {index}"

    @property
    def worker_processes(self) -> tuple[int, ...]:
        """The workers' process indices (their loss does not end the job)."""
        return tuple(self.process_of("worker", i) for i in range(self.num_workers))

    @property
    def is_chief(self) -> bool:
        return self.task_type == "chief"


def _from_tf_config(text: str) -> tuple[TaskRole, str]:
    try:
        config = json.loads(text)
        cluster, task = config["cluster"], config["task"]
        chief, ps, workers = cluster["chief"], cluster["ps"], cluster["worker"]
        kind, index = task["type"], int(task.get("index", 0))
    except (ValueError, KeyError, TypeError) as e:
        raise ClusterConfigError(
            f"TF_CONFIG is not a parameter-server cluster ({type(e).__name__}: {e}); got "
            f"{text!r}. It needs 'cluster' with 'chief' (one address), 'ps' and 'worker' lists "
            "and a 'task' with 'type' and 'index'."
        ) from None
    if len(chief) != 1:
        raise ClusterConfigError(
            f"TF_CONFIG 'cluster.chief' must list exactly one address; got {chief!r}."
        )
    role = TaskRole(kind, index, len(ps), len(workers))
    return role, str(chief[0])


def resolve_role(
    task_type: str | None = None,
    task_index: int | None = None,
    *,
    num_ps: int | None = None,
    num_workers: int | None = None,
    process_id: int | None = None,
    num_processes: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[TaskRole, str | None]:
    """This process's role, and the coordinator address when the description gives one.

    Examples:
        >>> from dtensor.runtime.roles import resolve_role
        >>> resolve_role(environ={"DTENSOR_COORDINATOR": "127.0.0.1:1", "DTENSOR_NUM_PROCESSES": "4",
        ...     "DTENSOR_PROCESS_ID": "2", "DTENSOR_TASK_TYPE": "worker", "DTENSOR_TASK_INDEX": "0",
        ...     "DTENSOR_NUM_PS": "1", "DTENSOR_NUM_WORKERS": "2"})
        (TaskRole(task_type='worker', task_index=0, num_ps=1, num_workers=2), '127.0.0.1:1')
        >>> resolve_role(num_ps=1, process_id=3, num_processes=4, environ={})[0].name_of(3)
        'worker 1'
    """
    env = os.environ if environ is None else environ
    if task_type is not None:
        if task_index is None or num_ps is None or num_workers is None:
            raise ClusterConfigError(
                f"resolve_role(task_type={task_type!r}) also needs task_index, num_ps and "
                f"num_workers; got task_index={task_index}, num_ps={num_ps}, "
                f"num_workers={num_workers}. Pass all four."
            )
        return TaskRole(task_type, task_index, num_ps, num_workers), env.get(ENV_COORDINATOR)
    if env.get(ENV_TASK_TYPE):
        role = TaskRole(
            env[ENV_TASK_TYPE],
            int_env(env, ENV_TASK_INDEX),
            int_env(env, ENV_NUM_PS),
            int_env(env, ENV_NUM_WORKERS),
        )
        return role, env.get(ENV_COORDINATOR)
    if env.get("TF_CONFIG") and '"ps"' in env["TF_CONFIG"]:
        return _from_tf_config(env["TF_CONFIG"])
    if process_id is None and env.get(ENV_PROCESS_ID):
        process_id, num_processes = int_env(env, ENV_PROCESS_ID), int_env(env, ENV_NUM_PROCESSES)
    if process_id is None or num_processes is None or num_ps is None:
        raise ClusterConfigError(
            "no parameter-server roles found: no DTENSOR_TASK_TYPE (python -m dtensor.launch "
            "--ps N --workers M), no TF_CONFIG with 'ps' and 'worker' lists, and no "
            f"num_ps with a process index (got num_ps={num_ps}, process_id={process_id}). "
            "Launch with --ps/--workers, set TF_CONFIG, or pass task_type and task_index."
        )
    workers = num_processes - 1 - num_ps
    probe = TaskRole("chief", 0, num_ps, max(workers, 0))
    kind, index = probe.task_of(process_id)
    return TaskRole(kind, index, num_ps, workers), env.get(ENV_COORDINATOR)


def join_cluster(
    task_type: str | None = None,
    task_index: int | None = None,
    *,
    num_ps: int | None = None,
    num_workers: int | None = None,
    local_device_count: int | None = None,
    heartbeat_timeout_s: float | None = None,
    timeout_s: float = 60,
) -> TaskRole:
    """Find this process's role (see the module docstring) and join the job.

    The job's processes form one ``jax.distributed`` job with recoverable
    tasks: a worker that dies is tolerated (the others go on; it may be
    restarted and join again), while the loss of the chief or of a ``ps``
    stops every task with one line naming it (exit status 75).

    Returns:
        This process's :class:`TaskRole` (also :func:`current_role`).

    Raises:
        ClusterConfigError: no roles found, or an inconsistent description.

    Examples:
        >>> from dtensor.runtime.roles import join_cluster
        >>> join_cluster()  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        dtensor.runtime.cluster.ClusterConfigError: no parameter-server roles found ...
    """
    import jax

    from dtensor.runtime import process

    if _current:
        return _current[0]
    role, address = resolve_role(task_type, task_index, num_ps=num_ps, num_workers=num_workers)
    jax.config.update("jax_enable_recoverability", True)
    cluster = (
        (None, None, None) if address is None else (address, role.num_processes, role.process_id)
    )
    process.initialize(
        *cluster,
        local_device_count=local_device_count,
        heartbeat_timeout_s=heartbeat_timeout_s,
        timeout_s=timeout_s,
        summary=False,
        tolerate=role.worker_processes,
        names={p: role.name_of(p) for p in range(role.num_processes)},
    )
    _current[:] = [role]
    return role


def current_role() -> TaskRole | None:
    """The role this process joined with :func:`join_cluster` (``None``: not a ps job).

    Examples:
        >>> from dtensor.runtime.roles import current_role
        >>> current_role() is None
        True
    """
    return _current[0] if _current else None
