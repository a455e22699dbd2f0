"""The errors of dtensor.checkpoint."""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointError", "DamagedCheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that is missing, unfinished, damaged, or does not match its target."""


class DamagedCheckpointError(CheckpointError):
    """A step whose files no longer match the checksums recorded when it was written.

    Attributes:
        step: the damaged step.
        array: the pytree path of the damaged array (``None`` when the damage
            is in a file that holds no single array, e.g. the manifest).
        file: the damaged or missing file, relative to the step directory.
        problem: what is wrong, in a few words (``"a file is truncated ..."``).
        checks: from :func:`dtensor.checkpoint.verify`, every step's verdict.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        array: str | None = None,
        file: str | None = None,
        problem: str = "damaged",
    ) -> None:
        super().__init__(message)
        self.step = step
        self.array = array
        self.file = file
        self.problem = problem
        self.checks: list[Any] = []
