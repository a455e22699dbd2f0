"""A real GCS JSON API on loopback for the tests: ``gcp-storage-emulator`` in a child process.

The session fixture starts one emulator per test process (each pytest-xdist
worker gets its own, at its own free port) and stops it by PID at the end.
The function fixture ``gcs`` sets the variables a user sets for an emulator
(``STORAGE_EMULATOR_HOST`` for gcsfs and Google's clients,
``TENSORSTORE_GCS_HTTP_URL`` for TensorStore) for one test only, gives it a
fresh ``gs://`` URL, runs it in an empty working directory and fails it when
anything was written under a local ``gs:`` directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

BUCKET = "dtensor-test"


@dataclasses.dataclass(frozen=True)
class Emulator:
    """A running emulator: its URL, its data directory (objects under ``.cloudstorage/BUCKET``)."""

    url: str
    data_dir: Path
    pid: int
    download_log: Path | None = None

    def downloads(self, prefix: str = "") -> list[str]:
        """The objects downloaded so far (one entry per read), those under ``prefix`` only."""
        if self.download_log is None or not self.download_log.exists():
            return []
        names = self.download_log.read_text().splitlines()
        return [n for n in names if n.startswith(prefix)]

    @property
    def env(self) -> dict[str, str]:
        """The variables that point GCS clients and TensorStore at it."""
        return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url}

    def object_path(self, url: str) -> Path:
        """Where the emulator keeps the object (or prefix) ``gs://BUCKET/...`` on disk."""
        assert url.startswith("gs://"), url
        return self.data_dir / ".cloudstorage" / url[len("gs://") :]


def _command() -> list[str]:
    """The emulator's command line, with the gaps to real GCS closed (see tests/gcs_server.py)."""
    return [sys.executable, str(Path(__file__).with_name("gcs_server.py"))]


@contextlib.contextmanager
def emulator(data_dir: Path, *, timeout_s: float = 60.0) -> Iterator[Emulator]:
    """Start ``gcp-storage-emulator`` on 127.0.0.1 at a port the system picks; stop it (by PID).

    The server binds port 0 and writes the port it got once it listens (tests/gcs_server.py):
    no port is picked free here and taken by another process before the emulator binds it,
    and no other process listening there is taken for this emulator.
    """
    logging.getLogger("gcsfs").setLevel(logging.ERROR)  # a credentials warning per call
    tag = uuid.uuid4().hex[:8]
    port_file = data_dir.parent / f"emulator-{tag}.port"
    log_path = data_dir.parent / f"emulator-{tag}.log"
    downloads = data_dir.parent / f"emulator-{tag}.downloads"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [*_command(), "-d", str(data_dir), "start", "--host", "127.0.0.1", "--port", "0"]
        + ["--default-bucket", BUCKET, "--port-file", str(port_file)]
        + ["--download-log", str(downloads)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"gcp-storage-emulator exited with {proc.returncode}: "
                    + log_path.read_text()[-2000:]
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"gcp-storage-emulator did not listen within {timeout_s} s: "
                    + log_path.read_text()[-2000:]
                )
            time.sleep(0.05)
        port = int(port_file.read_text())
        yield Emulator(f"http://127.0.0.1:{port}", data_dir, proc.pid, downloads)
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    """End a process this test run started: SIGTERM to its pid, SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def fresh_url(name: str) -> str:
    """A new, empty prefix in the test bucket."""
    safe = "".join(c if c.isalnum() else "-" for c in name)[:40]
    return f"gs://{BUCKET}/{safe}-{uuid.uuid4().hex[:8]}"
