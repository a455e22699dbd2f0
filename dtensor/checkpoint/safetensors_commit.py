"""How a safetensors save replaces the checkpoint already at its path: written beside it, then swapped.

A save never writes into the folder it replaces. Its files go into a sibling folder,
``NAME.safetensors-tmp`` (same parent, so the same file system or bucket), and only once
every process has written its files, and the index is there too, does the new folder take
the old one's place:

- On disk: the old folder is renamed aside (``NAME.safetensors-old``), the new one renamed
  into place, the old one removed. A save that fails while writing (``OSError: [Errno 27]
  File too large``, a full disk, a killed process) leaves the last checkpoint exactly as it
  was; a save that succeeds leaves none of the old one's shards. Files in the folder that
  are not the old checkpoint's (``config.json``, a tokenizer) are carried over (hard links,
  or copies where the file system has none). Only a crash between the two renames leaves
  no folder at the path: the old checkpoint is then whole in ``NAME.safetensors-old``, named
  by the error of a load, and put back by the next save.
- On disk, where the folder itself cannot be renamed (a mount point, a parent the job
  may not write, or the working directory): the same inside the folder, file by file. The
  new files go into its hidden ``.safetensors-tmp``; then the old checkpoint's files are
  moved into ``.safetensors-old`` (the index first) and the new ones into place (the index
  last). A failure while writing leaves the old checkpoint as it was; a crash during those
  renames leaves a folder without an index (refused by loads), and the next save puts the
  old files back first.
- In a bucket (``gs://``), which has no rename: the new files are uploaded under the
  sibling prefix, then the old index is deleted (nothing looks complete from then on), the
  old shards deleted, the new files copied in by the store itself (no upload; the index, or
  ``model.safetensors``, last) and the sibling prefix removed. A failure while uploading
  (the long part) leaves the old checkpoint as it was; one during the switch leaves a folder
  without an index, which a load refuses, and the whole new checkpoint under the sibling
  prefix.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from typing import Any

from dtensor.checkpoint import storage
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.safetensors_format import INDEX, SINGLE

__all__ = ["Staging", "aside_of", "write_error"]

_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
_TMP = ".safetensors-tmp"
_OLD = ".safetensors-old"


def aside_of(root: Any) -> Any:
    """Where a save puts the old checkpoint during its swap (``NAME.safetensors-old``)."""
    return root.parent / f"{root.name}{_OLD}"


def _weight_files(folder: Any) -> set[str]:
    """The names in ``folder`` that belong to the checkpoint there (not config or tokenizer)."""
    names = {p.name for p in folder.iterdir()} - {_TMP, _OLD}  # a swap's own, inside the folder
    mine = {n for n in names if n in (INDEX, SINGLE) or _SHARD.fullmatch(n) or ".tmp-" in n}
    if INDEX in names:
        with contextlib.suppress(ValueError, OSError, AttributeError):  # a damaged index: by name
            mine |= set(storage.read_json(folder / INDEX).get("weight_map", {}).values()) & names
    return mine


_FIXES = {
    27: "Free space, or raise the file-size limit (ulimit -f), on that file system",
    28: "Free space on that file system",
    122: "Free space, or raise the disk quota, on that file system",
    13: "Make the folder's parent writable by the job",
    30: "Save to a writable file system",
}


def write_error(error: BaseException, file: str, staging: Any, path: str) -> CheckpointError:
    """The error of a save whose write of ``file`` failed: what, where, that the old one is kept."""
    fix = _FIXES.get(getattr(error, "errno", None) or -1, "Fix the cause above")
    return CheckpointError(
        f"save_safetensors({path!r}): writing {file!r} (in {os.fspath(staging)!r}) failed: "
        f"{type(error).__name__}: {error}. The checkpoint at {path!r} is unchanged: the new one "
        f"was being written beside it and has been removed. {fix}, and save again."
    )


class Staging:
    """The sibling folder a save writes into, and the swap that makes it the checkpoint.

    :meth:`prepare`, :meth:`commit` and :meth:`discard` are called by one process (the
    first); every process writes its files into :attr:`folder` in between.
    """

    def __init__(self, root: Any, where: str) -> None:
        self.remote = storage.is_url(root)
        self.inside = False  # the swap done file by file inside the folder
        if not self.remote:  # a symlinked folder is replaced where it really is
            real = os.path.realpath(os.fspath(root))
            root = storage.resolve(real)
            self.inside = os.path.isdir(real) and not _renamable(real)
        self.root, self.where = root, where
        if self.inside:
            self.folder, self.aside = root / _TMP, root / _OLD
        else:
            self.folder, self.aside = root.parent / f"{root.name}{_TMP}", aside_of(root)

    def check_target(self) -> None:
        """Refuse a path that is a file (every process checks it, before any barrier)."""
        with storage.store_errors(self.root):
            is_file = self.root.is_file()
        if is_file:
            raise CheckpointError(
                f"save_safetensors: {self.where!r} is a file, but a safetensors checkpoint is a "
                f"folder ({SINGLE}, or shards and {INDEX}). Pass a folder's path (e.g. "
                f"{self.where.rstrip('/') + '-hf'!r}), or remove the file first."
            )

    def prepare(self) -> None:
        """An empty staging folder; what an earlier save left half done, settled."""
        with storage.store_errors(self.root):
            storage.refresh(self.root.parent)
            if self.inside and self.aside.exists():  # an earlier save died while swapping
                if not ((self.root / INDEX).exists() or (self.root / SINGLE).exists()):
                    for p in self.aside.iterdir():  # before its index: the old files back
                        os.replace(os.fspath(p), os.fspath(self.root / p.name))
                shutil.rmtree(self.aside)
            elif not self.remote and self.aside.exists():
                if self.root.exists():  # an earlier save swapped, then died: the old one
                    shutil.rmtree(self.aside)
                else:  # died between its two renames: the old checkpoint goes back
                    os.rename(self.aside, self.root)
            if self.folder.exists():  # an earlier save that failed or was killed
                self._remove(self.folder)
            self.root.parent.mkdir(parents=True, exist_ok=True)
            self.folder.mkdir()

    def discard(self) -> None:
        """Remove the staging folder (a failed save: the old checkpoint stays as it was)."""
        try:
            with storage.store_errors(self.root):
                self._remove(self.folder)
        except (OSError, CheckpointError) as e:  # the save's own error is the one raised
            warnings.warn(
                f"save_safetensors({self.where!r}) failed, and its unfinished files in "
                f"{os.fspath(self.folder)!r} could not be removed ({e}); the next save there "
                "removes them (or remove them by hand).",
                stacklevel=4,
            )

    def commit(self, written: list[str]) -> None:
        """Make the staging folder's ``written`` files (the index, or the one file, last) the
        checkpoint at the path; a :class:`CheckpointError` saying what is where if it fails."""
        try:
            with storage.store_errors(self.root):
                storage.refresh(self.root.parent)
                if self.remote:
                    self._commit_bucket(written)
                elif self.inside:
                    self._commit_inside(written)
                else:
                    self._commit_disk()
        except Exception as e:  # noqa: BLE001 - said with where each checkpoint now is
            what = f"{type(e).__name__}: {e}"
            if self.inside:
                raise CheckpointError(
                    f"save_safetensors({self.where!r}): moving the new files into place failed "
                    f"({what}); the folder has no complete checkpoint now, and the old one's "
                    f"files are in {os.fspath(self.aside)!r} (the next save puts them back "
                    "first). Fix the cause and save again."
                ) from e
            if self.remote:
                raise CheckpointError(
                    f"save_safetensors({self.where!r}): the new checkpoint is complete in "
                    f"{os.fspath(self.folder)!r}, but copying it into place failed ({what}); "
                    f"{self.where!r} now has no index, and loads refuse it. Copy the files of "
                    f"{os.fspath(self.folder)!r} into it ({INDEX} last), or save again."
                ) from e
            self.discard()
            where = (
                "is unchanged"
                if self.root.exists()
                else f"is whole in {os.fspath(self.aside)!r} (the next save puts it back)"
            )
            raise CheckpointError(
                f"save_safetensors({self.where!r}): putting the new checkpoint in place failed "
                f"({what}); the old checkpoint {where}. Fix the cause and save again."
            ) from e

    # ---------------------------------------------------------------- internals
    def _remove(self, folder: Any) -> None:
        if self.remote:
            storage.refresh(folder)
            if folder.exists():
                folder.rmtree()
        else:
            shutil.rmtree(folder)

    def _commit_disk(self) -> None:
        root, new = os.fspath(self.root), os.fspath(self.folder)
        if os.path.isdir(root):
            keep = {p.name for p in self.root.iterdir()} - _weight_files(self.root)
            keep -= {p.name for p in self.folder.iterdir()} | {_TMP, _OLD}  # the save's own
            for name in sorted(keep):  # config.json, a tokenizer...: carried over
                _link_or_copy(os.path.join(root, name), os.path.join(new, name))
            shutil.copymode(root, new)
            os.rename(root, os.fspath(self.aside))
            try:
                os.rename(new, root)
            except OSError:
                os.rename(os.fspath(self.aside), root)  # the old one back
                raise
            try:
                shutil.rmtree(self.aside)
            except OSError as e:
                warnings.warn(
                    f"save_safetensors({self.where!r}) is complete, but the old checkpoint "
                    f"moved aside to {os.fspath(self.aside)!r} could not be removed ({e}); "
                    "remove it by hand.",
                    stacklevel=4,
                )
        else:
            os.rename(new, root)

    def _commit_inside(self, written: list[str]) -> None:
        old = _weight_files(self.root)
        self.aside.mkdir()
        for name in [n for n in (INDEX, SINGLE) if n in old] + sorted(old - {INDEX, SINGLE}):
            os.rename(os.fspath(self.root / name), os.fspath(self.aside / name))  # index first
        last = [n for n in written if n in (INDEX, SINGLE)]
        for name in [n for n in written if n not in last] + last:
            os.replace(os.fspath(self.folder / name), os.fspath(self.root / name))
        shutil.rmtree(self.aside)
        shutil.rmtree(self.folder)

    def _commit_bucket(self, written: list[str]) -> None:
        from etils.epath import backend

        fs = backend.fsspec_backend.fs(os.fspath(self.root))
        if self.root.exists():
            old = _weight_files(self.root)
            for name in [n for n in (INDEX, SINGLE) if n in old] + sorted(old - {INDEX, SINGLE}):
                (self.root / name).unlink()  # the index first: nothing complete-looking
        else:
            self.root.mkdir(parents=True, exist_ok=True)
        last = [n for n in written if n in (INDEX, SINGLE)]
        for name in [n for n in written if n not in last] + last:
            fs.copy(os.fspath(self.folder / name), os.fspath(self.root / name))
        storage.refresh(self.root)
        self._remove(self.folder)


def _renamable(folder: str) -> bool:
    """Whether ``folder`` can be renamed: not a mount point, in a parent the job may write,
    and not the working directory (or one holding it: a process's directory stays put)."""
    cwd = os.path.realpath(os.getcwd())
    if cwd == folder or cwd.startswith(folder.rstrip(os.sep) + os.sep):
        return False
    return not os.path.ismount(folder) and os.access(os.path.dirname(folder), os.W_OK)


def _link_or_copy(src: str, dst: str) -> None:
    """``src`` at ``dst`` too: hard links (no bytes copied), or copies where links fail."""

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b, follow_symlinks=False)
        except OSError:
            shutil.copy2(a, b, follow_symlinks=False)

    if os.path.isdir(src) and not os.path.islink(src):
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    else:
        link(src, dst)
