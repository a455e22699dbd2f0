"""The multi-process runtime: cluster resolution, processes, the local launcher, distributed meshes."""

from dtensor.runtime.cluster import ClusterConfigError as ClusterConfigError
from dtensor.runtime.cluster import ClusterSpec as ClusterSpec
from dtensor.runtime.cluster import DistributedRuntimeError as DistributedRuntimeError
from dtensor.runtime.cluster import parse_tf_config as parse_tf_config
from dtensor.runtime.cluster import resolve_cluster as resolve_cluster
from dtensor.runtime.process import barrier as barrier
from dtensor.runtime.process import client_id as client_id
from dtensor.runtime.process import initialize as initialize
from dtensor.runtime.process import is_initialized as is_initialized
from dtensor.runtime.process import num_clients as num_clients
from dtensor.runtime.process import shutdown as shutdown
from dtensor.runtime.roles import TaskRole as TaskRole
from dtensor.runtime.roles import current_role as current_role
from dtensor.runtime.roles import join_cluster as join_cluster
from dtensor.runtime.serve import Server as Server
from dtensor.runtime.serve import serve as serve

__all__ = [
    "ClusterConfigError",
    "ClusterSpec",
    "DistributedRuntimeError",
    "Server",
    "TaskRole",
    "barrier",
    "client_id",
    "current_role",
    "initialize",
    "is_initialized",
    "join_cluster",
    "num_clients",
    "parse_tf_config",
    "resolve_cluster",
    "serve",
    "shutdown",
]
