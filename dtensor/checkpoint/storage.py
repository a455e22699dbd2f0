"""Where checkpoints live: a local directory or a URL (``gs://bucket/run``), through ``etils.epath``.

orbax resolves checkpoint directories with ``etils.epath`` (and writes arrays
with TensorStore's kvstores); everything here goes through the same layer, so a
local path and a bucket behave alike. A URL is never passed through
:mod:`pathlib`: ``Path("gs://b/x").absolute()`` is the *local* path
``<cwd>/gs:/b/x``.

On a bucket, orbax commits a step by writing ``commit_success.txt`` into it
last (object stores have no atomic rename); a step without it is unfinished and
never listed. Errors of the store (no such bucket, no credentials, permission
denied) become one :class:`~dtensor.checkpoint.CheckpointError` naming the URL
and the fix (:func:`store_errors`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from dtensor.checkpoint.errors import CheckpointError, DamagedCheckpointError

__all__ = [
    "is_url",
    "iter_files",
    "read_json",
    "refresh",
    "resolve",
    "size",
    "store_error",
    "store_errors",
    "tensorstore_url",
    "write_json",
]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` is a URL (``gs://...``, ``s3://...``), not a local path.

    Examples:
        >>> from dtensor.checkpoint.storage import is_url
        >>> is_url("gs://bucket/run"), is_url("/tmp/run"), is_url("run")
        (True, False, False)
    """
    return bool(_URL.match(os.fspath(directory)))


def resolve(directory: str | os.PathLike[str]) -> Any:
    """``directory`` as an ``etils.epath.Path``: a URL kept as it is, a local path made absolute.

    Examples:
        >>> from dtensor.checkpoint.storage import resolve
        >>> str(resolve("gs://bucket/run"))
        'gs://bucket/run'
    """
    from etils import epath

    text = os.fspath(directory)
    if is_url(text):
        if text.startswith("file://"):
            return epath.Path(os.path.abspath(text[len("file://") :]))
        return epath.Path(text)
    return epath.Path(os.path.abspath(text))


def refresh(path: Any) -> None:
    """Forget cached listings of a bucket (objects written by TensorStore or other hosts appear).

    Examples:
        >>> from dtensor.checkpoint.storage import refresh
        >>> refresh("/tmp")  # a local path: nothing is cached
    """
    if not is_url(path):
        return
    from etils.epath import backend

    with contextlib.suppress(AttributeError, ValueError):  # a scheme without a listing cache
        backend.fsspec_backend.fs(os.fspath(path)).invalidate_cache()


def size(path: Any) -> int:
    """The size in bytes of a file (local or in a bucket).

    Examples:
        >>> import tempfile
        >>> from dtensor.checkpoint.storage import resolve, size
        >>> p = resolve(tempfile.mkdtemp()) / "f"
        >>> _ = p.write_text("abc")
        >>> size(p)
        3
    """
    stat = path.stat()
    return int(getattr(stat, "length", getattr(stat, "st_size", 0)))


def iter_files(top: Any) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk`` of ``top`` (relative directory names), on disk or in a bucket.

    Examples:
        >>> import tempfile
        >>> from dtensor.checkpoint.storage import iter_files, resolve
        >>> top = resolve(tempfile.mkdtemp())
        >>> (top / "a").mkdir()
        >>> _ = (top / "a" / "f").write_text("x")
        >>> sorted((rel, files) for rel, _, files in iter_files(top))
        [('', []), ('a', ['f'])]
    """
    refresh(top)
    base = _URL.sub("", os.fspath(top)).rstrip("/")
    for root, dirs, files in top.walk():
        text = _URL.sub("", os.fspath(root)).rstrip("/")  # fsspec gives "bucket/..." roots
        if not text.startswith(base):
            raise ValueError(f"walking {os.fspath(top)!r} gave {os.fspath(root)!r}")
        yield text[len(base) :].lstrip("/"), dirs, files


def read_json(path: Any) -> Any:
    """The JSON value stored at ``path`` (see :func:`write_json`)."""
    return json.loads(path.read_text())


def write_json(path: Any, value: Any) -> None:
    """Store ``value`` as JSON at ``path``.

    Examples:
        >>> import tempfile
        >>> from dtensor.checkpoint.storage import read_json, resolve, write_json
        >>> p = resolve(tempfile.mkdtemp()) / "x.json"
        >>> write_json(p, {"b": 1, "a": [2]})
        >>> read_json(p)
        {'a': [2], 'b': 1}
    """
    path.write_text(json.dumps(value, sort_keys=True))


def tensorstore_url(path: Any) -> str:
    """A TensorStore kvstore URL for ``path`` (``file:///...`` or ``gs://...``), ending in ``/``.

    Examples:
        >>> from dtensor.checkpoint.storage import tensorstore_url
        >>> tensorstore_url("gs://bucket/run/3/state"), tensorstore_url("/data/run")
        ('gs://bucket/run/3/state/', 'file:///data/run/')
    """
    text = os.fspath(path).rstrip("/")
    return (text if is_url(text) else f"file://{text}") + "/"


# -------------------------------------------------------------------- errors
_FIXES = (
    (
        ("credential", "defaultcredentialserror", "unauthenticated", "401", "refresh token"),
        "no credentials for the store",
        "On a Cloud TPU VM the VM's service account is used; elsewhere run `gcloud auth "
        "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS (against an emulator, "
        "set STORAGE_EMULATOR_HOST and TENSORSTORE_GCS_HTTP_URL)",
    ),
    (
        ("403", "permission", "forbidden", "access denied"),
        "permission denied",
        "Grant the account the job runs as Storage Object Admin (roles/storage.objectAdmin) on "
        "the bucket, or use a bucket it can write",
    ),
    (
        ("bucket does not exist", "nosuchbucket", "404", "not found", "no such bucket"),
        "the bucket does not exist",
        "Create it (`gcloud storage buckets create gs://BUCKET --location=REGION`, in the TPU's "
        "region) or fix the URL",
    ),
)


def store_error(url: str, error: BaseException) -> CheckpointError:
    """One :class:`CheckpointError` for a failure of the store behind ``url``: what, where, the fix.

    Examples:
        >>> from dtensor.checkpoint.storage import store_error
        >>> e = store_error("gs://b/run", PermissionError("403 Forbidden"))
        >>> str(e).split(". ")[0]
        "cannot use checkpoint storage 'gs://b/run': permission denied (PermissionError: 403 Forbidden)"
    """
    text = f"{type(error).__name__}: {error}"
    low = text.lower()
    first = text.strip().splitlines()[0][:200] if text.strip() else type(error).__name__
    for marks, what, fix in _FIXES:
        if any(m in low for m in marks):
            return CheckpointError(
                f"cannot use checkpoint storage {url!r}: {what} ({first}). {fix}."
            )
    return CheckpointError(
        f"cannot use checkpoint storage {url!r}: {first}. Check that the URL is right and the "
        "store reachable from this host (for gs://, the bucket exists and the job's account may "
        "write it)."
    )


@contextlib.contextmanager
def store_errors(directory: Any) -> Iterator[None]:
    """Re-raise failures of a bucket's store as one :class:`CheckpointError` naming the URL.

    Local paths are left alone (their errors already say what is wrong), and so
    are our own errors and errors that are not the store's (orbax refusing a
    value keeps its own message).

    Examples:
        >>> from dtensor.checkpoint.storage import store_errors
        >>> try:
        ...     with store_errors("gs://b/run"):
        ...         raise FileNotFoundError("404 bucket does not exist")
        ... except ValueError as e:
        ...     print(type(e).__name__, "create it" in str(e).lower())
        CheckpointError True
    """
    try:
        yield
    except (CheckpointError, DamagedCheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - gcsfs/google-auth/TensorStore errors, explained
        if not (is_url(directory) and _from_store(e)):
            raise  # not the store's: e.g. orbax refusing a value, said better by its own error
        raise store_error(os.fspath(directory), e) from e


_STORE_MODULES = ("google.", "gcsfs", "aiohttp", "requests", "urllib3", "fsspec", "s3fs")


def _from_store(error: BaseException) -> bool:
    """Whether ``error`` came from the storage layer (I/O, HTTP, auth), not from the values saved."""
    if isinstance(error, OSError):
        return True
    if type(error).__module__.startswith(_STORE_MODULES):
        return True
    return bool(re.search(r"https?:|gs://|\bgcs\b|credential|bucket", str(error), re.I))
