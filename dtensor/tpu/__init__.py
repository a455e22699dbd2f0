"""TPU topologies without a TPU, and ahead-of-time compiles of a training script for them."""

from dtensor.tpu.search import FitResult as FitResult
from dtensor.tpu.search import fit as fit

__all__ = ["FitResult", "fit"]
