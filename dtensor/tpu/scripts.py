"""The training scripts ``python -m dtensor.aot`` compiles, and the devices it compiles them for.

:func:`load_script` imports a script as a module and checks its ``aot_step`` hook;
:func:`topology_devices` gives a TPU or GPU topology's devices. Both are re-exported by
:mod:`dtensor.tpu.aot`, and used by the plan search (:mod:`dtensor.tpu.search`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["HOOK", "AotError", "load_script", "topology_devices"]

HOOK = "aot_step"


class AotError(ValueError):
    """A script or command line the AOT compiler cannot use."""


def load_script(path: str | os.PathLike[str]) -> ModuleType:
    """Import a Python script as a module (not as ``__main__``) and check it has the hook.

    Args:
        path: the script's file.

    Returns:
        The module.

    Raises:
        AotError: no such file, or no ``aot_step`` in it.
    """
    file = Path(path)
    if not file.is_file():
        raise AotError(
            f"script {str(path)!r} does not exist (looked in {Path.cwd()}); give the path of a "
            "training script that defines aot_step(argv, *, devices), e.g. examples/train.py."
        )
    spec = importlib.util.spec_from_file_location(f"_dtensor_aot_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise AotError(f"script {str(path)!r} cannot be imported; give a .py file.")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.resolve().parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(file.resolve().parent))
    if not callable(getattr(module, HOOK, None)):
        raise AotError(
            f"script {str(path)!r} defines no {HOOK}(argv, *, devices) function; add one that "
            "parses the script's arguments, builds its strategy over devices and returns "
            "(strategy, train_step, abstract_args) -- see examples/train.py."
        )
    return module


def topology_devices(topology: str, *, num_slices: int = 1) -> list[Any]:
    """The devices of a TPU topology (``"v5e:4x4"``) or a GPU one (``"h100:2x8"``).

    Examples:
        >>> from dtensor.tpu.scripts import topology_devices
        >>> len(topology_devices("h100:2x8", num_slices=2)), len(topology_devices("v5e:2x2"))
        (32, 4)
    """
    from dtensor.gpu.topology import GPU_MODELS, gpu_topology, parse_gpu_topology
    from dtensor.tpu.topology import tpu_topology

    if topology.strip().lower().partition(":")[0] not in GPU_MODELS:
        return tpu_topology(topology, num_slices=num_slices)
    model, slices, hosts, per_host = parse_gpu_topology(topology)
    if num_slices > 1 and slices > 1:
        raise AotError(
            f"--topology {topology} already names {slices} slices; drop --num-slices {num_slices} "
            f"or write the topology as {model}:{hosts}x{per_host}."
        )
    return gpu_topology(f"{model}:{max(slices, num_slices)}x{hosts}x{per_host}")
