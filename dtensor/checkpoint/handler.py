"""The orbax item that carries one small JSON per process (``<item>/process_<i>.json``).

Used for each process's shard checksums (``checksums/``) and its input
pipeline's position (``data/``). orbax's own JSON item is written by the
primary process only; this one is written by every process, each into its own
file, through orbax's public handler interface (``CheckpointHandler`` +
``register_with_handler``), so the files are part of the step that orbax
commits atomically (renamed into place on disk, ``commit_success.txt`` written
last in a bucket).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from dtensor.checkpoint import processes

__all__ = ["checksum_args"]


@functools.cache
def checksum_args() -> type:
    """The ``CheckpointArgs`` class whose handler writes this process's checksum record."""
    import orbax.checkpoint as ocp

    class ChecksumHandler(ocp.CheckpointHandler):
        """Writes ``process_<i>.json`` on every process; read back directly, never via orbax."""

        def save(self, directory: Any, *args: Any, **kwargs: Any) -> None:
            item = kwargs["args"].item
            path = directory / f"process_{processes.process_index()}.json"
            path.write_text(json.dumps(item, sort_keys=True))  # directory: an epath.Path

        def restore(self, directory: Any, *args: Any, **kwargs: Any) -> Any:
            return json.loads((directory / f"process_{processes.process_index()}.json").read_text())

    @ocp.args.register_with_handler(ChecksumHandler, for_save=True)
    @dataclasses.dataclass
    class ChecksumSave(ocp.args.CheckpointArgs):
        item: dict[str, Any]

    return ChecksumSave
