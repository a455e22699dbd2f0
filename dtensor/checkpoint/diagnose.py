"""Which saved array a damaged file holds: read each array's recorded shards straight from disk.

Also the check of other processes' data files: :func:`find_array` over every
recorded shard reads each process's bytes where they are stored (disk or bucket).

orbax stores the arrays of a step in one OCDBT database (``state/``) whose data
files mix many arrays, so a file's name does not say which arrays it holds.
When a file of a step is damaged, :func:`find_array` opens each array with
TensorStore (as orbax wrote it: zarr over OCDBT), reads its recorded shards and
compares their checksums; the first array that cannot be read or differs is
the one named in the error. Only used once damage is known, never on the
restore path.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np

from dtensor.checkpoint import storage

__all__ = ["find_array", "param_names"]


def param_names(step_dir: Any) -> dict[str, str] | None:
    """Our path (``a/b/0``) -> orbax's parameter name (``a.b.0``), from ``state/_METADATA``."""
    try:
        tree = json.loads((step_dir / "state" / "_METADATA").read_text())["tree_metadata"]
        out = {}
        for entry in tree.values():
            keys = [str(k["key"]) for k in entry["key_metadata"]]
            out["/".join(keys)] = ".".join(keys)
        return out
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the metadata itself is damaged: no single array to name


def _open(step_dir: Any, param: str) -> Any:
    import tensorstore as ts

    spec = {
        "driver": "zarr",
        "kvstore": {
            "driver": "ocdbt",
            "base": storage.tensorstore_url(step_dir / "state"),
            "path": f"{param}/",
        },
    }
    return ts.open(spec, open=True, read=True).result()


def find_array(step_dir: Any, records: dict[str, list[dict[str, Any]]]) -> str | None:
    """The first array (in path order) whose recorded shards cannot be read or differ, or None."""
    names = param_names(step_dir)
    if not names:
        return None
    for path in sorted(records):
        param = names.get(path)
        if param is None:
            continue
        try:
            arr = _open(step_dir, param)
            for rec in records[path]:
                index = tuple(slice(a, b) for a, b in rec["index"])
                data = np.ascontiguousarray(arr[index].read().result())
                if zlib.crc32(data.reshape(-1).view(np.uint8).data) != rec["crc32"]:
                    return path
        except Exception:  # noqa: BLE001 - any TensorStore failure means this array is unreadable
            return path
    return None
