"""Layout-aware checkpoints over orbax-checkpoint: save, restore, reshard, verify.

A checkpoint directory (a local path or a URL such as ``gs://bucket/run``,
resolved by ``etils.epath`` as orbax resolves it; see
:mod:`dtensor.checkpoint.storage`) holds one sub-directory per step (orbax's
``CheckpointManager`` layout). Each step holds three items: ``state``, the
arrays (orbax's ``StandardSave``, each process writing its own shards),
``manifest``, a small JSON file with the step, the mesh, each array's path,
shape, dtype and layout (:meth:`Layout.to_string`), and the library versions,
and ``checksums``, the CRC-32 of every shard and file as written (see
:mod:`dtensor.checkpoint.integrity`); with ``data=``, a fourth, ``data``, holds
each process's input-pipeline position. On disk orbax writes a step into a
temporary ``*.orbax-checkpoint-tmp*`` directory and renames it once complete;
in a bucket (no rename) it writes ``commit_success.txt`` into the step last.
Either way a process killed mid-write leaves the earlier steps intact, and
unfinished steps are never listed or restored. A step whose bytes changed afterwards (a
flipped bit, a truncated or deleted file) is *damaged*: restoring it raises a
:class:`CheckpointError` naming the step, the array and the file, and a
restore without ``step=`` skips it with a warning and falls back to the newest
intact step.

What can be saved, anywhere inside the tree: arrays (laid out or not), Flax
NNX modules and optimizers (their ``nnx.state``), NNX ``State``, Linen params
(boxed or not), optax states, typed PRNG keys, NumPy arrays and scalars, Python
scalars.

What ``target`` means on restore (it decides the structure of the result and
where every array goes; values are bit-identical whatever the layouts):

* ``None``: the saved structure, as plain containers (dicts with string keys,
  lists). Each array in the layout it was saved in when all of that mesh's
  devices exist here; otherwise replicated on the current mesh (``with
  mesh:``), or on all devices when there is none. NumPy arrays and scalars and
  Python scalars come back as they were saved (type and dtype, ``int64``
  included), on the host.
* a :class:`Mesh`: the saved structure, every array replicated on that mesh.
* a :class:`LayoutMap`, a function ``(path, leaf) -> Layout | None``, or any
  object with a ``variable_layout(path, leaf)`` method (a strategy): the saved
  structure, each array in the layout it gives (``None``: replicated on the
  strategy's mesh, else the current mesh).
* a pytree like the saved one, whose leaves say where each array goes: a
  :class:`Layout`, a ``jax.Array`` (its sharding; a live model's current
  layout), a ``jax.ShapeDtypeStruct`` (its sharding), a NumPy array or scalar
  or a Python scalar (restored on the host, as that type). NNX modules and
  optimizers in the tree are updated in place. A structure, shape or dtype
  that differs from the checkpoint raises a :class:`CheckpointError` naming
  the first differing paths.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from dtensor.checkpoint import datastate, integrity, local_tier, processes, storage
from dtensor.checkpoint.canonical import canon, rebuild
from dtensor.checkpoint.errors import CheckpointError, DamagedCheckpointError
from dtensor.checkpoint.handler import checksum_args
from dtensor.checkpoint.manifest import MANIFEST_FORMAT, prepare_save
from dtensor.checkpoint.quiet import collect_abandoned_reads, quiet_orbax
from dtensor.checkpoint.targets import finish_saved, is_policy, saved_abstract, target_abstract
from dtensor.checkpoint.tiers import NOTHING, LocalTierMethods
from dtensor.core.mesh import Mesh

__all__ = ["Checkpointer", "CheckpointError"]

_STATE, _MANIFEST = "state", "manifest"


_TMP_MARK = ".orbax-checkpoint-tmp"


def _ocp() -> Any:
    import orbax.checkpoint as ocp

    return ocp


# --------------------------------------------------------------- Checkpointer
class Checkpointer(LocalTierMethods):
    """Numbered, layout-aware, self-verifying checkpoints in one directory (over ``ocp.CheckpointManager``).

    Args:
        directory: where the steps live (created when missing, unless
            ``create=False``).
        max_to_keep: keep only the newest this many steps (``None``: all).
        save_interval_steps: :meth:`save` writes only steps that are a
            multiple of this (``force=True`` writes any step).
        async_save: return from :meth:`save` once the arrays are copied off
            the devices, and write the files in the background (training goes
            on); :meth:`wait` blocks until they are complete.
        create: create ``directory`` when it does not exist.
        verify: check every restored array against the checksums recorded
            when it was written (the default; ``restore(..., verify=False)``
            skips it for one call).
        local_directory: a second, *local* tier on each host's fast storage
            (a RAM disk or local SSD; see :mod:`dtensor.checkpoint.local_tier`):
            every :meth:`save` also writes there (and :meth:`save_local` only
            there), each process its own shards and a peer's copy. A restore
            takes the newest step of either tier, the local one when both
            have it.
        local_max_to_keep: how many local steps each process keeps.

    Examples:
        >>> import dtensor, jax.numpy as jnp, tempfile
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> w = dtensor.copy_to_mesh(jnp.arange(16.0), dtensor.Layout(["x"], mesh))
        >>> with dtensor.checkpoint.Checkpointer(tempfile.mkdtemp(), max_to_keep=2) as ckpt:
        ...     for step in range(4):
        ...         _ = ckpt.save(step, {"w": w + step})
        ...     ckpt.wait()
        ...     ckpt.all_steps(), ckpt.latest_step()
        ...     float(ckpt.restore()["w"][1])
        ([2, 3], 3)
        4.0
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
        create: bool = True,
        verify: bool = True,
        local_directory: str | os.PathLike[str] | None = None,
        local_max_to_keep: int = 2,
    ) -> None:
        ocp = _ocp()
        self.directory = storage.resolve(directory)
        with storage.store_errors(self.directory):
            missing = not create and not self.directory.is_dir()
        if missing:
            raise CheckpointError(
                f"checkpoint directory {str(self.directory)!r} does not exist. Check the path, or "
                "save a checkpoint there first."
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(
                f"max_to_keep={max_to_keep!r} is not valid; use a positive int or None (keep all)."
            )
        if save_interval_steps < 1:
            raise ValueError(
                f"save_interval_steps={save_interval_steps!r} is not valid; use a positive int."
            )
        cm = ocp.checkpoint_managers
        if processes.solo() and create:  # orbax leaves this to us when one process saves alone
            self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            create=create and not processes.solo(),
            enable_async_checkpointing=True,  # sync saves wait; the commit hook needs this
            save_decision_policy=cm.FixedIntervalPolicy(save_interval_steps),
            preservation_policy=cm.LatestN(n=max_to_keep),
            async_options=ocp.AsyncOptions(post_finalization_callback=self._record_files),
            **processes.orbax_options(ocp),
        )
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.async_save = async_save
        self.verify = verify
        self.restored_step: int | None = None
        self.restored_tier: str | None = None
        self.local = (
            None
            if local_directory is None
            else local_tier.LocalTier(local_directory, max_to_keep=local_max_to_keep)
        )
        self._pending: int | None = None
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        solo = processes.orbax_options(ocp)  # handlers of a save by this process alone need it too
        for item, save_args, restore_args, handler in (
            (
                _STATE,
                ocp.args.StandardSave,
                ocp.args.StandardRestore,
                ocp.StandardCheckpointHandler,
            ),
            (_MANIFEST, ocp.args.JsonSave, ocp.args.JsonRestore, ocp.JsonCheckpointHandler),
        ):
            instance = handler(**solo) if solo else None
            registry.add(item, save_args, instance)
            registry.add(item, restore_args, instance)
        registry.add(integrity.CHECKSUMS, checksum_args())
        registry.add(datastate.DATA, checksum_args())
        with storage.store_errors(self.directory):
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, handler_registry=registry
            )

    # -------------------------------------------------------------- steps
    def all_steps(self) -> list[int]:
        """The complete steps in the directory, oldest first (unfinished ones are ignored).

        Complete is not intact: see :meth:`latest_step` and :func:`verify`.
        """
        storage.refresh(self.directory)
        with storage.store_errors(self.directory):
            self._manager.reload()
            return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete step whose files pass the quick check, or ``None``.

        A damaged step (a missing or truncated file, a changed manifest or
        metadata file, a missing checksum record) is skipped with a warning.
        A changed byte inside a large data file is found when the step is
        restored (or by :func:`verify`), not here.
        """
        for step in reversed(self.all_steps()):
            try:
                self.quick_check(step)
            except DamagedCheckpointError as e:
                warnings.warn(f"skipping checkpoint step {step}: {e}", stacklevel=2)
                continue
            return step
        return None

    def unfinished(self) -> list[str]:
        """Names of unfinished step directories, left by an interrupted write.

        On disk: orbax's temporary ``*.orbax-checkpoint-tmp*`` directories; in
        a bucket: step directories without orbax's ``commit_success.txt``.
        """
        storage.refresh(self.directory)
        if not self.directory.is_dir():
            return []
        done = {str(s) for s in self._manager.all_steps()}
        return sorted(
            p.name
            for p in self.directory.iterdir()
            if _TMP_MARK in p.name or (p.name.isdigit() and p.name not in done and p.is_dir())
        )

    def delete(self, steps: list[int]) -> None:
        """Delete these steps (on the primary process; every process calls this)."""
        for step in steps:
            self._manager.delete(step)

    def step_dir(self, step: int) -> Any:
        """The directory of ``step``."""
        return self.directory / str(step)

    # --------------------------------------------------------------- save
    def save(self, step: int, tree: Any, *, force: bool = False, data: Any = None) -> bool:
        """Save ``tree`` as ``step``; returns whether a checkpoint was started.

        Nothing is written when ``step`` is not a multiple of
        ``save_interval_steps`` or not newer than the latest step, unless
        ``force``. With ``async_save`` the files are written in the background.
        Every shard's checksum is computed here, from the bytes handed to
        orbax, and committed with the step. ``data``, an input iterator with
        ``get_state()``/``set_state()``, has its position saved with the step
        (``restore(..., data=it)`` puts it back).

        Raises:
            CheckpointError: ``step`` already exists.
        """
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step={step!r} is not valid; checkpoint steps are non-negative ints.")
        step = int(step)
        if not force and not self._manager.should_save(step):
            return False
        if step in self._manager.all_steps():
            raise CheckpointError(
                f"step {step} already exists in {str(self.directory)!r}; steps are never "
                "overwritten. Save under a new step number."
            )
        ocp = _ocp()
        position = None if data is None else datastate.capture(data)
        self._manager.wait_until_finished()  # one step in flight: the commit hook knows which
        arrays, manifest = prepare_save(canon(tree), step)
        if self.local is not None:  # first: it stands whatever becomes of the persistent write
            self._save_local(step, arrays, manifest, position)
        record = {
            "format": 1,
            "algorithm": "crc32",
            "step": step,
            "process_index": processes.process_index(),
            "process_count": processes.process_count(),
            "arrays": integrity.shard_checksums(arrays),
        }
        items = {
            _STATE: ocp.args.StandardSave(arrays),
            _MANIFEST: ocp.args.JsonSave(manifest),
            integrity.CHECKSUMS: checksum_args()(record),
        }
        if position is not None:
            items[datastate.DATA] = checksum_args()(position)
        self._pending = step
        with storage.store_errors(self.directory):
            started = bool(self._manager.save(step, args=ocp.args.Composite(**items), force=True))
        if not self.async_save:
            self.wait()
        return started

    def _record_files(self) -> None:
        """orbax's post-finalization hook (primary process): the file record, before the rename."""
        step = self._pending
        if step is None:
            return
        tmp = list(self.directory.glob(f"{step}{_TMP_MARK}*"))  # stale ones: older writes (disk)
        newest = max(tmp, key=lambda p: os.stat(p).st_mtime_ns) if tmp else self.step_dir(step)
        integrity.write_files_record(newest)

    def wait(self) -> None:
        """Block until every started save is complete on disk (or in the bucket), both tiers."""
        with storage.store_errors(self.directory):
            self._manager.wait_until_finished()
        if self.local is not None:
            self.local.wait()

    # ------------------------------------------------------------ restore
    def _check_step(self, step: int | None) -> list[int]:
        """The steps to try, newest first: ``[step]``, or every complete step."""
        steps = self.all_steps()
        if not steps:
            tmp = self.unfinished()
            extra = f" (only unfinished writes: {tmp[:3]})" if tmp else ""
            raise CheckpointError(
                f"no complete checkpoint in {str(self.directory)!r}{extra}. Save one first, or "
                "point at the directory that holds the step sub-directories."
            )
        if step is None:
            return steps[::-1]
        if step not in steps:
            raise CheckpointError(
                f"step {step} is not a complete checkpoint in {str(self.directory)!r}; the "
                f"complete steps are {steps}. Pass one of those, or step=None for the latest."
            )
        return [step]

    def _read_manifest(self, step: int) -> dict[str, Any]:
        ocp = _ocp()
        try:
            with quiet_orbax():
                out = self._manager.restore(
                    step, args=ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()})
                )
            manifest = out[_MANIFEST]
        except KeyError:  # orbax: the item is not in this step
            manifest = None
        except Exception:  # noqa: BLE001 - orbax/json errors on a damaged file, re-raised as ours
            if (self.step_dir(step) / _MANIFEST).is_dir():
                raise integrity.damaged(
                    step,
                    str(self.directory),
                    "its manifest cannot be read",
                    file=f"{_MANIFEST}/metadata",
                ) from None
            manifest = None
        if not isinstance(manifest, dict) or "leaves" not in manifest:
            raise CheckpointError(
                f"step {step} in {str(self.directory)!r} has no dtensor manifest; it was not written "
                "by dtensor.checkpoint. Restore it with orbax directly."
            )
        return manifest

    def quick_check(self, step: int) -> tuple[dict[str, Any], integrity.Records | None, dict]:
        """The manifest and checksum records of ``step``, after the cheap file checks."""
        step_dir, where = self.step_dir(step), str(self.directory)
        storage.refresh(step_dir)
        if not (step_dir / integrity.CHECKSUMS).is_dir():
            manifest = self._read_manifest(step)
            if manifest.get("format", 1) >= MANIFEST_FORMAT:
                raise integrity.damaged(
                    step, where, "its checksum records are missing", file=integrity.CHECKSUMS
                )
            return manifest, None, {}  # written before checksums existed: nothing to check
        records, files = integrity.load_records(step_dir, step, where)
        integrity.check_files(step_dir, step, where, files, full=False, records=records)
        return self._read_manifest(step), records, files

    def manifest(self, step: int | None = None) -> dict[str, Any]:
        """The JSON manifest of ``step`` (default: the latest complete step)."""
        return self._read_manifest(self._check_step(step)[0])

    def restore(
        self,
        step: int | None = None,
        target: Any = None,
        *,
        verify: bool | None = None,
        data: Any = None,
    ) -> Any:
        """Restore ``step`` (default: the newest intact one) as ``target`` says.

        See the module docstring for what ``target`` may be. NNX modules and
        optimizers in ``target`` are updated in place (and also returned), once
        the restored values have passed their checksums. The step restored is
        in :attr:`restored_step`. ``data``, an input iterator with
        ``set_state()``, is moved to the position saved with that step
        (re-split when another number of processes saved it, where the
        iterator allows).

        Raises:
            CheckpointError: no such complete step, ``step`` is damaged, every
                step is damaged, or ``target`` does not match.
        """
        verify = self.verify if verify is None else verify
        if (
            self.local is not None
            and step is None
            and not (target is None or is_policy(target) or isinstance(target, Mesh))
        ):
            out = self._restore_local(target, data)
            if out is not NOTHING:
                return out
        steps = self._check_step(step)
        skipped: list[DamagedCheckpointError] = []
        for s in steps:
            try:
                out = self._restore_step(s, target, verify)
            except DamagedCheckpointError as e:
                if step is not None:
                    raise
                warnings.warn(f"skipping checkpoint step {s}: {e}", stacklevel=2)
                skipped.append(e)
                continue
            if data is not None:
                self.restore_data(s, data)
            self.restored_step, self.restored_tier = s, "persistent"
            return out
        raise CheckpointError(
            f"every step in {str(self.directory)!r} is damaged ({sorted(steps)}); the newest: "
            f"{skipped[0]}"
        )

    def restore_data(self, step: int, data: Any) -> None:
        """Move the input iterator ``data`` to the position saved with ``step``."""
        where = str(self.directory)
        datastate.check_iterator(data, f"restoring step {step} from {where!r}")
        with storage.store_errors(self.directory):
            records = datastate.load(self.step_dir(step), step, where)
        datastate.apply(data, records, step, where)

    def _restore_step(self, step: int, target: Any, verify: bool) -> Any:
        if verify:
            manifest, records, files = self.quick_check(step)
        else:
            manifest, records, files = self._read_manifest(step), None, {}
        by_path = {e["path"]: e for e in manifest["leaves"]}
        where = str(self.directory)
        ocp = _ocp()
        saved = target is None or isinstance(target, Mesh) or is_policy(target)
        step_dir = self.step_dir(step)
        meta = self._orbax(
            step,
            files,
            records,
            lambda: self._manager.item_metadata(step)[_STATE] if saved else None,
        )
        if saved:
            abstract = saved_abstract(getattr(meta, "tree", meta), target, by_path)
        else:
            abstract = target_abstract(
                canon(target), by_path, f"checkpoint step {step} in {where!r}"
            )
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract)})
        restored = self._orbax(
            step, files, records, lambda: self._manager.restore(step, args=args)[_STATE]
        )
        if records is not None:
            bad, _ = integrity.check_arrays(restored, records)
            if integrity.agree(len(bad)):
                raise integrity.mismatch(step_dir, step, where, files, bad)
        if saved:
            return finish_saved(restored, by_path, target)
        return rebuild(target, restored)

    def _orbax(
        self, step: int, files: dict, records: integrity.Records | None, fn: Callable[[], Any]
    ) -> Any:
        """``fn()`` (an orbax call); a failure re-raised as our one error, orbax's debris cleared."""
        try:
            with quiet_orbax():
                return fn()
        except Exception as e:  # noqa: BLE001 - orbax/TensorStore errors, explained below
            failure = self._read_failure(step, files, records, e)
        # Raised out here, cut from orbax's exception, so that it (and the reads it abandoned) can go.
        failure.__context__ = None
        failure = failure.with_traceback(None)
        collect_abandoned_reads()
        raise failure

    def _read_failure(
        self, step: int, files: dict, records: integrity.Records | None, error: BaseException
    ) -> CheckpointError:
        """Our error for an orbax failure: the damaged file and array when the records tell."""
        if not files:  # restored without verification: the records may still explain it
            try:
                _, records, files = self.quick_check(step)
            except DamagedCheckpointError as e:
                return e
            except CheckpointError:
                pass
        where = str(self.directory)
        return integrity.read_failure(self.step_dir(step), step, where, files, records, error)

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wait for pending saves (both tiers) and release the manager."""
        self._manager.close()
        if self.local is not None:
            self.local.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Checkpointer({str(self.directory)!r}, max_to_keep={self.max_to_keep}, "
            f"save_interval_steps={self.save_interval_steps})"
        )
