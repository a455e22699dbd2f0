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

__all__ = [
    "ClusterConfigError",
    "ClusterSpec",
    "DistributedRuntimeError",
    "barrier",
    "client_id",
    "initialize",
    "is_initialized",
    "num_clients",
    "parse_tf_config",
    "resolve_cluster",
    "shutdown",
]
