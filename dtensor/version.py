"""The installed distribution's version (``jax-dtensor``), or a placeholder in a bare source tree."""

from __future__ import annotations

from importlib import metadata

__all__ = ["__version__"]

try:
    __version__: str = metadata.version("jax-dtensor")
except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH, never installed
    __version__ = "0.0.0+unknown"
