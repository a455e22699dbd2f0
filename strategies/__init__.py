"""strategies: every tf.distribute strategy (and more) as a thin preset over dtensor."""

from dtensor import ReduceOp as ReduceOp
from strategies import failure_handling as failure_handling
from strategies.base import Strategy as Strategy
from strategies.context import get_replica_context as get_replica_context
from strategies.context import in_cross_replica_context as in_cross_replica_context
from strategies.coordinator import ClusterCoordinator as ClusterCoordinator
from strategies.coordinator import PerWorkerValues as PerWorkerValues
from strategies.coordinator import RemoteValue as RemoteValue
from strategies.coordinator import WorkerFailure as WorkerFailure
from strategies.coordinator import remote_function as remote_function
from strategies.current import get_strategy as get_strategy
from strategies.current import has_strategy as has_strategy
from strategies.partitioners import FixedShardsPartitioner as FixedShardsPartitioner
from strategies.partitioners import MaxSizePartitioner as MaxSizePartitioner
from strategies.partitioners import MinSizePartitioner as MinSizePartitioner
from strategies.presets.central_storage import CentralStorageStrategy as CentralStorageStrategy
from strategies.presets.fsdp import FullyShardedStrategy as FullyShardedStrategy
from strategies.presets.hybrid import HybridStrategy as HybridStrategy
from strategies.presets.layout_strategy import LayoutStrategy as LayoutStrategy
from strategies.presets.mirrored import MirroredStrategy as MirroredStrategy
from strategies.presets.multi_worker_mirrored import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from strategies.presets.one_device import OneDeviceStrategy as OneDeviceStrategy
from strategies.presets.parameter_server import ParameterServerStrategy as ParameterServerStrategy
from strategies.presets.tensor_parallel import TensorParallelStrategy as TensorParallelStrategy
from strategies.presets.tpu import TPUStrategy as TPUStrategy
from strategies.reads.mixed_precision import MixedPrecision as MixedPrecision
from strategies.reads.remat_plan import RematPolicy as RematPolicy
from strategies.registry import PRESET_NAMES as PRESET_NAMES
from strategies.registry import describe_presets as describe_presets
from strategies.registry import from_name as from_name
from strategies.replica.cross_device_ops import AllReduceCrossDeviceOps as AllReduceCrossDeviceOps
from strategies.replica.cross_device_ops import (
    CommunicationImplementation as CommunicationImplementation,
)
from strategies.replica.cross_device_ops import CommunicationOptions as CommunicationOptions
from strategies.replica.cross_device_ops import CrossDeviceOps as CrossDeviceOps
from strategies.replica.cross_device_ops import CrossDeviceOpsError as CrossDeviceOpsError
from strategies.replica.cross_device_ops import (
    HierarchicalCopyAllReduce as HierarchicalCopyAllReduce,
)
from strategies.replica.cross_device_ops import NcclAllReduce as NcclAllReduce
from strategies.replica.cross_device_ops import ReductionToOneDevice as ReductionToOneDevice
from strategies.replica.values import InputContext as InputContext
from strategies.replica.values import PerReplica as PerReplica
from strategies.replica.values import ReplicaContext as ReplicaContext
from strategies.replica.values import ValueContext as ValueContext
from strategies.version import __version__ as __version__

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
    "MixedPrecision",
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
    "RematPolicy",
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
    "has_strategy",
    "in_cross_replica_context",
    "remote_function",
]
