"""``gcp-storage-emulator``'s command line, with two gaps to real GCS closed (run by tests/gcs.py).

1. A media download carries the object's ``x-goog-generation`` (and
   metageneration) header, as real GCS sends it: TensorStore's OCDBT driver
   reads the manifest's generation from it and makes its next write
   conditional on it; without the header that condition is "Malformed
   StorageGeneration" and the write fails.
2. The listen queue is deeper than ``http.server``'s default of 5, which
   TensorStore's parallel requests overflow.

And ``--download-log PATH``: each media download's object name is appended to PATH (a test
counts the reads a restore made). And ``--port-file PATH`` (with ``--port 0``): the server binds a port the
system picks and writes it to PATH once it listens, so a starter never picks a
"free" port another process may take first, nor mistakes another emulator
listening there for its own.

The protocol served is otherwise the emulator's own.
"""

import http.server
import os
import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # noqa: BLE001 - not found: the emulator's own handler answers 404
        obj = None
    if obj is not None and _Server.download_log:
        with open(_Server.download_log, "a") as f:
            f.write(request.params["object_id"] + "\n")
    if obj is not None:
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    return _download(request, response, storage, *args, **kwargs)


objects.download = download  # before the server module builds its routes


class _Server(http.server.HTTPServer):
    """The emulator's HTTP server: a deeper listen queue; the port it got, once listening."""

    request_queue_size = 1024
    port_file = ""
    download_log = ""

    def server_activate(self) -> None:
        super().server_activate()  # listen(): connections are queued from here on
        if self.port_file:  # written whole, then renamed: a reader never sees half of it
            tmp = f"{self.port_file}.tmp"
            with open(tmp, "w") as f:
                f.write(str(self.server_address[1]))
            os.replace(tmp, self.port_file)


http.server.HTTPServer = _Server  # the emulator builds its server from this name at start

from gcp_storage_emulator.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "gcp-storage-emulator"
    args = sys.argv[1:]
    if "--port-file" in args:  # ours: start on --port 0 and say which port the system gave
        i = args.index("--port-file")
        _Server.port_file = args[i + 1]
        del args[i : i + 2]
    if "--download-log" in args:  # ours: name each object downloaded, one per line
        i = args.index("--download-log")
        _Server.download_log = args[i + 1]
        del args[i : i + 2]
    main(args)
