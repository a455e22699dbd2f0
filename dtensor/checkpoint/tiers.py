"""The local tier's side of :class:`dtensor.checkpoint.Checkpointer`: save there, restore from it.

See :mod:`dtensor.checkpoint.local_tier` (what is written) and
:mod:`dtensor.checkpoint.local_restore` (how a restore moves blocks).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import jax

from dtensor.checkpoint import datastate, exchange, local_restore, local_tier, processes
from dtensor.checkpoint.canonical import canon, rebuild
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.manifest import prepare_save
from dtensor.checkpoint.targets import target_abstract
from dtensor.core.tree import path_str

__all__ = ["NOTHING", "LocalTierMethods"]

NOTHING = object()
"""What :meth:`LocalTierMethods._restore_local` returns when the local tier cannot serve."""
_TARGET = "target: "


def _all_positions(position: dict[str, Any]) -> list[dict[str, Any]]:
    if processes.solo():
        return [position]
    return [json.loads(b) for b in exchange.allgather_bytes(json.dumps(position).encode())]


class LocalTierMethods:
    """The methods of a ``Checkpointer`` that use its local tier (``self.local``)."""

    local: local_tier.LocalTier | None
    async_save: bool
    directory: Any
    restored_step: int | None
    restored_tier: str | None

    def all_steps(self) -> list[int]:  # the persistent tier's: Checkpointer's
        raise NotImplementedError

    def save_local(self, step: int, tree: Any, *, data: Any = None) -> None:
        """Save ``tree`` as ``step`` in the local tier only (every process calls this).

        Each process writes its own shards and receives a peer's copy (see
        :mod:`dtensor.checkpoint.local_tier`); the files are written in the
        background, one step in flight.
        """
        if self.local is None:
            raise CheckpointError(
                f"{self!r} has no local tier; pass local_directory= (each host's fast local "
                "storage) to save there, or call save() for the persistent tier."
            )
        position = None if data is None else datastate.capture(data)
        arrays, manifest = prepare_save(canon(tree), int(step))
        self._save_local(int(step), arrays, manifest, position)
        if not self.async_save:
            self.local.wait()

    def _save_local(self, step: int, arrays: Any, manifest: dict, position: Any) -> None:
        assert self.local is not None
        leaves, _ = jax.tree_util.tree_flatten_with_path(arrays)
        flat = {path_str(path): leaf for path, leaf in leaves}
        head = {
            "format": 1,
            "process_count": processes.process_count(),
            "manifest": manifest,
            # every process's input position (small JSON): any survivor can give them all
            "data": None if position is None else _all_positions(position),
        }
        self.local.save(step, flat, head, alone=processes.solo())

    def local_steps(self) -> list[int]:
        """The local tier's steps on this process, oldest first (``[]`` without one)."""
        return [] if self.local is None else self.local.steps()

    def has_steps(self) -> bool:
        """Whether either tier holds a step anywhere in the job (every process calls this)."""
        if self.all_steps():
            return True
        if self.local is None:
            return False
        mine = b"1" if self.local.steps() else b"0"
        return b"1" in exchange.allgather_bytes(mine)

    def _restore_local(self, target: Any, data: Any) -> Any:
        """The newest local step when it is at least as new as the persistent tier's (collective).

        See :mod:`dtensor.checkpoint.local_restore`. Every process takes the
        same path through the collectives below, failures included.
        """
        assert self.local is not None
        persistent = self.all_steps()
        chosen = local_restore.plan(self.local, persistent[-1] if persistent else None)
        if chosen is None:
            return NOTHING
        where = f"the local tier in {self.local.root}"
        by_path = {e["path"]: e for e in chosen.manifest["leaves"]}
        failure, abstract, want = "", None, []
        try:
            abstract = target_abstract(canon(target), by_path, f"step {chosen.step} in {where}")
            want = local_restore.needed(abstract)
        except CheckpointError as e:  # the target does not match the step: the user's to fix
            failure = _TARGET + str(e)
        lost = local_restore.fetch(chosen, want)
        records = None if data is None else local_restore.all_data_records(chosen)
        restored = None
        if not failure:
            try:
                if lost:
                    raise KeyError(
                        f"{len(lost)} block(s) are held by no process, the first {lost[0][0]!r} "
                        f"{[list(b) for b in lost[0][1]]}"
                    )
                if records is not None and len(records) != chosen.saved_processes():
                    raise KeyError(f"the input positions of {len(records)} processes, not all")
                restored = local_restore.build(chosen, abstract)
            except (KeyError, ValueError) as e:
                failure = str(e)
        failures = exchange.allgather_bytes(failure.encode())
        bad = [(p, f.decode()) for p, f in enumerate(failures) if f]
        for _, text in bad:
            if text.startswith(_TARGET):
                raise CheckpointError(text[len(_TARGET) :])
        if bad:
            fallback = f"persistent step {persistent[-1]}" if persistent else "nothing"
            warnings.warn(
                f"local checkpoint step {chosen.step} cannot be restored (process {bad[0][0]}: "
                f"{bad[0][1]}); restoring {fallback} from {str(self.directory)!r} instead",
                stacklevel=3,
            )
            return NOTHING
        if records is not None:
            datastate.apply(data, records, chosen.step, where)
        self.restored_step, self.restored_tier = chosen.step, chosen.tier
        return rebuild(target, restored)
