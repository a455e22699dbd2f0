"""dtensor: DTensor-style meshes and layouts, natively on JAX.

Importing dtensor never initialises JAX's backends.
"""

from dtensor import checkpoint as checkpoint
from dtensor.analysis.explain import Report as Report
from dtensor.analysis.explain import explain as explain
from dtensor.core.arrays import call_with_layout as call_with_layout
from dtensor.core.arrays import check_layout as check_layout
from dtensor.core.arrays import copy_to_mesh as copy_to_mesh
from dtensor.core.arrays import fetch_layout as fetch_layout
from dtensor.core.arrays import pack as pack
from dtensor.core.arrays import relayout as relayout
from dtensor.core.arrays import unpack as unpack
from dtensor.core.attention import context_attention as context_attention
from dtensor.core.attention import context_mode as context_mode
from dtensor.core.collectives import all_gather as all_gather
from dtensor.core.collectives import all_reduce as all_reduce
from dtensor.core.collectives import broadcast as broadcast
from dtensor.core.collectives import reduce_scatter as reduce_scatter
from dtensor.core.experts import expert_mlp as expert_mlp
from dtensor.core.layout import UNSHARDED as UNSHARDED
from dtensor.core.layout import Layout as Layout
from dtensor.core.layout import LayoutError as LayoutError
from dtensor.core.mesh import Mesh as Mesh
from dtensor.core.mesh import MeshError as MeshError
from dtensor.core.mesh import create_mesh as create_mesh
from dtensor.core.mesh import current_mesh as current_mesh
from dtensor.core.partial import PartialArray as PartialArray
from dtensor.core.pipeline import bubble_fraction as bubble_fraction
from dtensor.core.pipeline import pipeline as pipeline
from dtensor.core.reduce_op import ReduceOp as ReduceOp
from dtensor.core.rules import LayoutMap as LayoutMap
from dtensor.core.rules import distribute as distribute
from dtensor.core.rules import resolve_layouts as resolve_layouts
from dtensor.core.visualize import visualize as visualize
from dtensor.data.dataset import DTensorDataset as DTensorDataset
from dtensor.gpu.topology import gpu_topology as gpu_topology
from dtensor.runtime.cluster import ClusterConfigError as ClusterConfigError
from dtensor.runtime.cluster import DistributedRuntimeError as DistributedRuntimeError
from dtensor.runtime.distributed_mesh import create_distributed_mesh as create_distributed_mesh
from dtensor.runtime.process import barrier as barrier
from dtensor.runtime.process import client_id as client_id
from dtensor.runtime.process import initialize as initialize
from dtensor.runtime.process import num_clients as num_clients
from dtensor.runtime.process import shutdown as shutdown
from dtensor.tpu.topology import tpu_topology as tpu_topology
from dtensor.version import __version__ as __version__

__all__ = [
    "ClusterConfigError",
    "DTensorDataset",
    "DistributedRuntimeError",
    "UNSHARDED",
    "Layout",
    "LayoutError",
    "LayoutMap",
    "Mesh",
    "MeshError",
    "PartialArray",
    "ReduceOp",
    "Report",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "bubble_fraction",
    "call_with_layout",
    "check_layout",
    "checkpoint",
    "client_id",
    "context_attention",
    "context_mode",
    "copy_to_mesh",
    "create_distributed_mesh",
    "create_mesh",
    "current_mesh",
    "distribute",
    "expert_mlp",
    "explain",
    "fetch_layout",
    "gpu_topology",
    "initialize",
    "num_clients",
    "pack",
    "pipeline",
    "reduce_scatter",
    "relayout",
    "resolve_layouts",
    "shutdown",
    "tpu_topology",
    "unpack",
    "visualize",
]
