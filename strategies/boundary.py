"""JAX errors caught where user code enters the library, re-raised as ours when the cause is a layout choice.

One so far: a model whose layers pass ``out_sharding=`` (Flax's annotated
Gemma does, to its einsums) traced on a mesh with Auto axes. JAX accepts
``out_sharding`` only on Explicit axes and says so deep in the trace; the fix
is the mesh the strategy was given (see JAX-NOTES, "A real annotated model").
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from dtensor import LayoutError

if TYPE_CHECKING:
    from strategies.base import Strategy

__all__ = ["explicit_axes_error"]

_AUTO_SPEC = re.compile(
    r"PartitionSpec passed to (?P<api>\S+) cannot contain axis names that are of type Auto or "
    r"Manual\. Got PartitionSpec: (?P<spec>.*?) with axis name: (?P<axis>\S+) of type: "
    r"(?P<type>[\w.]+)\.(?: This error occurs at source:\s*(?P<source>.*))?",
    re.DOTALL,
)


def explicit_axes_error(err: BaseException, strategy: Strategy, where: str) -> LayoutError | None:
    """Our four-part error for JAX's "out_sharding needs Explicit axes" ``err``, else ``None``.

    ``where`` is what the user called (``"run()"``, ``"building Net in scope()"``).
    """
    found = _AUTO_SPEC.search(str(err))
    if found is None or not found["type"].endswith("Auto"):
        return None  # Manual axes (inside shard_map) are another matter
    mesh = strategy.mesh
    dims = ", ".join(f"({n!r}, {k})" for n, k in mesh.shape.items())
    explicit = f'dtensor.create_mesh([{dims}], axis_types="explicit")'
    if hasattr(strategy, "layout_map"):  # LayoutStrategy: the user's own mesh
        fix = (
            f"Build the mesh with Explicit axes and pass it (and a LayoutMap built on it) to the "
            f"strategy: strategies.LayoutStrategy({explicit}, layout_map)"
        )
    else:
        fix = (
            f"{type(strategy).__name__} builds its mesh with Auto axes (what unannotated models "
            f"need); run an annotated model under strategies.LayoutStrategy({explicit}), whose "
            "layouts follow the model's annotations"
        )
    source = (found["source"] or "").strip().splitlines()
    at = f" (at {source[0].strip()})" if source and source[0].strip() else ""
    return LayoutError(
        f"{where}: the model passes out_sharding={found['spec']} to {found['api']}{at}, which JAX "
        f"accepts only on Explicit mesh axes, but {strategy!r} runs on Auto axes (mesh axis "
        f"{found['axis']!r} is Auto). {fix}; or remove out_sharding= from the model's layers and "
        "let the compiler choose."
    )
