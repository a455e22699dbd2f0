"""Check a checkpoint directory against its recorded checksums, without restoring it."""

from __future__ import annotations

import dataclasses
import os

from dtensor.checkpoint import integrity
from dtensor.checkpoint.checkpointer import Checkpointer
from dtensor.checkpoint.errors import CheckpointError, DamagedCheckpointError
from dtensor.checkpoint.oneshot import existing

__all__ = ["StepCheck", "check_steps", "verify"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepCheck:
    """The verdict on one step.

    Attributes:
        step: the step number.
        status: ``"ok"`` (every recorded checksum matches), ``"damaged"``, or
            ``"unverified"`` (written before checksums were recorded).
        arrays: the number of arrays in the step (from its checksum record).
        bytes: the bytes of the files checked.
        error: the :class:`DamagedCheckpointError` of a damaged step.
    """

    step: int
    status: str
    arrays: int = 0
    bytes: int = 0
    error: DamagedCheckpointError | None = None


def _check_one(ckpt: Checkpointer, step: int) -> StepCheck:
    step_dir, where = ckpt.step_dir(step), str(ckpt.directory)
    try:
        manifest, records, files = ckpt.quick_check(step)
        if records is None:
            return StepCheck(step, "unverified", arrays=len(manifest.get("leaves", ())))
        nbytes = integrity.check_files(step_dir, step, where, files, full=True, records=records)
        if any(r.get("process", 0) for recs in records.values() for r in recs):
            _check_other_processes(step_dir, step, where, records)
    except DamagedCheckpointError as e:
        return StepCheck(step, "damaged", error=e)
    return StepCheck(step, "ok", arrays=len(records), bytes=nbytes)


def _check_other_processes(step_dir, step: int, where: str, records: integrity.Records) -> None:
    """Every process's shards, read where they are stored and compared with their checksums.

    The primary's file record holds only the sizes of other processes' data
    files; their bytes are checked here, shard by shard.
    """
    from dtensor.checkpoint.diagnose import find_array

    bad = find_array(step_dir, records)
    if bad is not None:
        raise integrity.damaged(
            step, where, "a shard does not match its checksum", array=bad, file="state/"
        )


def check_steps(directory: str | os.PathLike[str], step: int | None = None) -> list[StepCheck]:
    """A :class:`StepCheck` for ``step`` (default: every complete step), oldest first; never raises on damage."""

    with existing(directory) as ckpt:
        steps = ckpt.all_steps()
        if step is not None and step not in steps:
            raise CheckpointError(
                f"step {step} is not a complete checkpoint in {str(ckpt.directory)!r}; the "
                f"complete steps are {steps}. Pass one of those, or step=None to check them all."
            )
        return [_check_one(ckpt, s) for s in ([step] if step is not None else steps)]


def verify(directory: str | os.PathLike[str], *, step: int | None = None) -> list[StepCheck]:
    """Check the recorded checksums of ``step`` (default: every step) without restoring.

    Every byte of every file the step was written with is read and compared
    with the CRC-32 recorded at save time; a damaged file is traced to the
    array it holds by reading the arrays' recorded shards.

    Returns:
        One :class:`StepCheck` per step, oldest first (``"ok"`` or
        ``"unverified"`` for steps written before checksums existed).

    Raises:
        CheckpointError: the directory or ``step`` does not exist; a
            :class:`DamagedCheckpointError` naming the step, the array and
            the file when a step is damaged (the newest damaged one; its
            ``checks`` attribute holds every step's verdict).

    Examples:
        >>> import dtensor, jax.numpy as jnp, tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = dtensor.checkpoint.save(d, {"w": jnp.zeros((2, 3))}, step=5)
        >>> [(c.step, c.status, c.arrays) for c in dtensor.checkpoint.verify(d)]
        [(5, 'ok', 1)]
    """
    checks = check_steps(directory, step)
    damaged = [c for c in checks if c.status == "damaged"]
    if damaged:
        error = damaged[-1].error or DamagedCheckpointError("damaged", step=damaged[-1].step)
        if len(damaged) > 1:
            others = [c.step for c in damaged[:-1]]
            error = DamagedCheckpointError(
                f"{error} Steps {others} are damaged too.",
                step=error.step,
                array=error.array,
                file=error.file,
                problem=error.problem,
            )
        error.checks = checks
        raise error
    return checks
