"""HybridStrategy, the preset that composes every parallelism, split by role.

- :mod:`strategies.hybrid.mesh_plan`: the six axes in mesh order, and the pipeline over
  ``stage`` (schedule, blocks found in a model, the plan a step runs by);
- :mod:`strategies.hybrid.rules`: where each variable goes (Megatron on ``tensor``,
  experts on ``expert``, stacks on ``stage``, FSDP over ``fsdp``) and the batch;
- :mod:`strategies.hybrid.options`: how a step is traced and its parameters read;
- :mod:`strategies.hybrid.strategy`: :class:`HybridStrategy`, those roles put together.

``strategies.HybridStrategy`` is the public name; ``strategies.presets.hybrid`` is its
preset module and ``strategies.presets.tensor_parallel`` the thin preset over it.
"""

from strategies.hybrid.mesh_plan import SCHEDULES as SCHEDULES
from strategies.hybrid.rules import expert_dim as expert_dim
from strategies.hybrid.rules import megatron_specs as megatron_specs
from strategies.hybrid.strategy import HybridStrategy as HybridStrategy

__all__ = ["SCHEDULES", "HybridStrategy", "expert_dim", "megatron_specs"]
