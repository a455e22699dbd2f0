"""`HybridStrategy`: data x stage x fsdp x context x expert x tensor (MaxText's and
torchtitan's N-D mesh). Its mesh plan, variable rules and step options live by role in
:mod:`strategies.hybrid`, below the presets, so that ``TensorParallelStrategy`` can be a
thin preset over it while presets never import each other."""

from __future__ import annotations

from strategies.hybrid.strategy import HybridStrategy

__all__ = ["HybridStrategy"]
