"""TPU topologies without a TPU, ahead-of-time compiles for them, and the search for the plan."""

from dtensor.tpu.search import FitResult as FitResult
from dtensor.tpu.search import SearchResult as SearchResult
from dtensor.tpu.search import fit as fit
from dtensor.tpu.search import search_plans as search_plans

__all__ = ["FitResult", "SearchResult", "fit", "search_plans"]
