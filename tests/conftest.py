"""Test set-up: 8 simulated CPU devices, requested before any JAX operation."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# ------------------------------------------- one compilation cache for the run's processes
# The processes the tests start (the demo, dtensor.launch workers, notebooks' kernels) compile
# the same CPU programs again and again: JAX's persistent compilation cache, one directory per
# run, shared by the xdist workers' children. It is read from the environment when a process
# imports jax, so it applies to those children and not to the test processes themselves (jax is
# imported above): their TPU/GPU compiles for libtpu/XLA:GPU topologies cannot be read back from
# the cache without a device client and would only warn. Removed at exit by whoever made it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="dtensor-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# Scripts that tests start as real processes are not test modules (and set up JAX
# their own way at import): keep them out of collection, doctests included.
collect_ignore_glob = ["workers_ckpt/*", "multiprocess/workers/*", "gcs_server.py"]


# ------------------------------------------------------------ a GCS API on loopback
import pytest  # noqa: E402

from tests.gcs import Emulator, emulator, fresh_url  # noqa: E402


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory):
    """One ``gcp-storage-emulator`` per test process (per xdist worker), stopped by PID at the end."""
    with emulator(tmp_path_factory.mktemp("gcs") / "data") as em:
        yield em


@pytest.fixture
def gcs(gcs_emulator: Emulator, monkeypatch: pytest.MonkeyPatch, tmp_path, request):
    """A fresh ``gs://`` URL; the emulator's variables set for this test only; no local ``gs:``.

    The test runs in an empty working directory, and fails when anything was
    written under a local ``gs:`` directory (a URL taken for a path).
    """
    for key, value in gcs_emulator.env.items():
        monkeypatch.setenv(key, value)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    yield fresh_url(request.node.name)
    assert not (work / "gs:").exists(), "a gs:// URL was written to local disk as ./gs:"
