"""strategies: every tf.distribute strategy (and more) as a thin preset over dtensor."""

from dtensor import ReduceOp as ReduceOp

from . import failure_handling as failure_handling
from .base import Strategy as Strategy
from .base import get_replica_context as get_replica_context
from .base import get_strategy as get_strategy
from .base import in_cross_replica_context as in_cross_replica_context
from .central_storage import CentralStorageStrategy as CentralStorageStrategy
from .coordinator import ClusterCoordinator as ClusterCoordinator
from .coordinator_values import PerWorkerValues as PerWorkerValues
from .coordinator_values import RemoteValue as RemoteValue
from .coordinator_values import WorkerFailure as WorkerFailure
from .cross_device_ops import AllReduceCrossDeviceOps as AllReduceCrossDeviceOps
from .cross_device_ops import CommunicationImplementation as CommunicationImplementation
from .cross_device_ops import CommunicationOptions as CommunicationOptions
from .cross_device_ops import CrossDeviceOps as CrossDeviceOps
from .cross_device_ops import CrossDeviceOpsError as CrossDeviceOpsError
from .cross_device_ops import HierarchicalCopyAllReduce as HierarchicalCopyAllReduce
from .cross_device_ops import NcclAllReduce as NcclAllReduce
from .cross_device_ops import ReductionToOneDevice as ReductionToOneDevice
from .fsdp import FullyShardedStrategy as FullyShardedStrategy
from .layout_strategy import LayoutStrategy as LayoutStrategy
from .mirrored import MirroredStrategy as MirroredStrategy
from .multi_worker_mirrored import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from .one_device import OneDeviceStrategy as OneDeviceStrategy
from .parameter_server import ParameterServerStrategy as ParameterServerStrategy
from .partitioners import FixedShardsPartitioner as FixedShardsPartitioner
from .partitioners import MaxSizePartitioner as MaxSizePartitioner
from .partitioners import MinSizePartitioner as MinSizePartitioner
from .registry import PRESET_NAMES as PRESET_NAMES
from .registry import describe_presets as describe_presets
from .registry import from_name as from_name
from .tensor_parallel import HybridStrategy as HybridStrategy
from .tensor_parallel import TensorParallelStrategy as TensorParallelStrategy
from .tpu import TPUStrategy as TPUStrategy
from .values import InputContext as InputContext
from .values import PerReplica as PerReplica
from .values import ReplicaContext as ReplicaContext
from .values import ValueContext as ValueContext

__all__ = [
    "AllReduceCrossDeviceOps",
    "CentralStorageStrategy",
    "ClusterCoordinator",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "CrossDeviceOpsError",
    "FixedShardsPartitioner",
    "FullyShardedStrategy",
    "HierarchicalCopyAllReduce",
    "HybridStrategy",
    "InputContext",
    "LayoutStrategy",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "PRESET_NAMES",
    "ParameterServerStrategy",
    "PerReplica",
    "PerWorkerValues",
    "ReduceOp",
    "ReductionToOneDevice",
    "RemoteValue",
    "ReplicaContext",
    "Strategy",
    "TPUStrategy",
    "TensorParallelStrategy",
    "ValueContext",
    "WorkerFailure",
    "describe_presets",
    "failure_handling",
    "from_name",
    "get_replica_context",
    "get_strategy",
    "in_cross_replica_context",
]
