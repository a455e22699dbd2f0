"""Asynchronous parameter-server training: ``ClusterCoordinator`` (TensorFlow's names).

In one process (:mod:`strategies.coordinator.coordinator`) the parameter
devices and the worker groups are this process's devices; across processes
(:mod:`strategies.coordinator.cluster`, :mod:`strategies.coordinator.service`)
the chief drives ``ps`` and ``worker`` tasks that run the same script.
"""

from strategies.coordinator import service as _service  # registers the ps and worker services
from strategies.coordinator.coordinator import ClusterCoordinator as ClusterCoordinator
from strategies.coordinator.coordinator import CoordinatorStats as CoordinatorStats
from strategies.coordinator.remote import RemoteFunction as RemoteFunction
from strategies.coordinator.remote import remote_function as remote_function
from strategies.coordinator.values import PerWorkerDataset as PerWorkerDataset
from strategies.coordinator.values import PerWorkerIterator as PerWorkerIterator
from strategies.coordinator.values import PerWorkerValues as PerWorkerValues
from strategies.coordinator.values import RemoteValue as RemoteValue
from strategies.coordinator.values import StaleCommit as StaleCommit
from strategies.coordinator.values import WorkerFailure as WorkerFailure

del _service

__all__ = [
    "ClusterCoordinator",
    "CoordinatorStats",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
    "RemoteFunction",
    "RemoteValue",
    "StaleCommit",
    "WorkerFailure",
    "remote_function",
]
