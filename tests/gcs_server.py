"""``gcp-storage-emulator``'s command line, with two gaps to real GCS closed (run by tests/gcs.py).

1. A media download carries the object's ``x-goog-generation`` (and
   metageneration) header, as real GCS sends it: TensorStore's OCDBT driver
   reads the manifest's generation from it and makes its next write
   conditional on it; without the header that condition is "Malformed
   StorageGeneration" and the write fails.
2. The listen queue is deeper than ``http.server``'s default of 5, which
   TensorStore's parallel requests overflow.

The protocol served is otherwise the emulator's own.
"""

import http.server
import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # noqa: BLE001 - not found: the emulator's own handler answers 404
        obj = None
    if obj is not None:
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    return _download(request, response, storage, *args, **kwargs)


objects.download = download  # before the server module builds its routes
http.server.HTTPServer.request_queue_size = 1024

from gcp_storage_emulator.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "gcp-storage-emulator"
    main()
