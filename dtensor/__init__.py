"""dtensor: DTensor-style meshes and layouts, natively on JAX.

Importing dtensor never initialises JAX's backends.
"""

from . import checkpoint as checkpoint
from . import report as report
from .api import call_with_layout as call_with_layout
from .api import check_layout as check_layout
from .api import copy_to_mesh as copy_to_mesh
from .api import fetch_layout as fetch_layout
from .api import pack as pack
from .api import relayout as relayout
from .api import unpack as unpack
from .collectives import all_gather as all_gather
from .collectives import all_reduce as all_reduce
from .collectives import broadcast as broadcast
from .collectives import reduce_scatter as reduce_scatter
from .distributed_mesh import create_distributed_mesh as create_distributed_mesh
from .input import DTensorDataset as DTensorDataset
from .inspect import Report as Report
from .inspect import explain as explain
from .layout import UNSHARDED as UNSHARDED
from .layout import Layout as Layout
from .layout import LayoutError as LayoutError
from .mesh import Mesh as Mesh
from .mesh import MeshError as MeshError
from .mesh import create_mesh as create_mesh
from .mesh import current_mesh as current_mesh
from .partial import PartialArray as PartialArray
from .reduce_op import ReduceOp as ReduceOp
from .rules import LayoutMap as LayoutMap
from .rules import distribute as distribute
from .rules import resolve_layouts as resolve_layouts
from .runtime import ClusterConfigError as ClusterConfigError
from .runtime import DistributedRuntimeError as DistributedRuntimeError
from .runtime import barrier as barrier
from .runtime import client_id as client_id
from .runtime import initialize as initialize
from .runtime import num_clients as num_clients
from .runtime import shutdown as shutdown
from .tpu import tpu_topology as tpu_topology
from .visualize import visualize as visualize

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
    "call_with_layout",
    "check_layout",
    "checkpoint",
    "client_id",
    "copy_to_mesh",
    "create_distributed_mesh",
    "create_mesh",
    "current_mesh",
    "distribute",
    "explain",
    "fetch_layout",
    "initialize",
    "num_clients",
    "pack",
    "reduce_scatter",
    "relayout",
    "resolve_layouts",
    "shutdown",
    "tpu_topology",
    "unpack",
    "visualize",
]
