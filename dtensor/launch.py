"""``python -m dtensor.launch -n N -- CMD...``: N local processes on one coordinator.

The launcher lives in :mod:`dtensor.runtime.launch`; this module is its command line.
"""

import sys

from dtensor.runtime.launch import LaunchResult as LaunchResult
from dtensor.runtime.launch import launch as launch
from dtensor.runtime.launch import main as main

__all__ = ["LaunchResult", "launch", "main"]

if __name__ == "__main__":
    sys.exit(main())
