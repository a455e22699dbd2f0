"""``python -m dtensor.aot --topology v5e:4x4 -- SCRIPT ...``: compile a training step for a TPU topology.

The compiler driver lives in :mod:`dtensor.tpu.aot`; this module is its command line.
"""

import sys

from dtensor.tpu.aot import cli as cli
from dtensor.tpu.aot import main as main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    sys.exit(cli())
