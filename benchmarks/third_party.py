"""Third-party model code the benchmarks run unchanged, fetched at install time (never vendored).

    python -m benchmarks.third_party          # what `make third-party` runs
    python -m benchmarks.third_party --if-pinned   # make test-latest: skip an unpinned flax

Flax's own Gemma (``examples/gemma`` of the Flax repository) ships in the
flax sdist on PyPI. :func:`fetch` downloads the sdist of the *installed* flax
version (``pip download --no-deps --no-binary :all:``), checks it against the
sha256 pinned in :data:`FLAX_SDIST_SHA256`, and unpacks ``examples/gemma/*.py``
into ``sys.prefix/share/flax-examples/<version>/gemma`` (outside the repository).
:func:`gemma_dir` returns that folder, or raises :class:`MissingThirdParty`
naming the make target, so a test run never downloads anything.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

__all__ = [
    "FLAX_SDIST_SHA256",
    "MissingThirdParty",
    "cache_dir",
    "fetch",
    "flax_version",
    "gemma_dir",
]

#: sha256 of the flax sdist on PyPI, by version. A flax upgrade adds its line here.
FLAX_SDIST_SHA256: dict[str, str] = {
    "0.12.8": "1bb438775b967a3f1f42b9c3d4ddf1d2883cd6406589f9cecdc244634036bdc4",
    # the newest flax (make test-latest)
    "0.12.12": "103cc503c94219513b73027aa0e93aac408adfd3fcdfb1df85e9d147219e4896",
}
MAKE_TARGET = "make third-party"


class MissingThirdParty(RuntimeError):
    """Flax's example code is not in the cache: run ``make third-party``."""


def flax_version() -> str:
    """The installed flax's version."""
    return metadata.version("flax")


def cache_dir(version: str | None = None) -> Path:
    """``sys.prefix/share/flax-examples/<version>``: where :func:`fetch` unpacks the examples."""
    return Path(sys.prefix) / "share" / "flax-examples" / (version or flax_version())


def gemma_dir(version: str | None = None) -> Path:
    """The unpacked ``examples/gemma`` of the installed flax; raises if it was never fetched.

    Raises:
        MissingThirdParty: the cache has no ``gemma/transformer.py`` for this flax version.
    """
    version = version or flax_version()
    path = cache_dir(version) / "gemma"
    if not (path / "transformer.py").is_file():
        raise MissingThirdParty(
            f"Flax's examples/gemma for flax {version} is not in {path}; run `{MAKE_TARGET}` "
            "(or `python -m benchmarks.third_party`) once to fetch it from the flax sdist on PyPI."
        )
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(version: str | None = None) -> Path:
    """Download the flax sdist, check its sha256 and unpack ``examples/gemma/*.py``; returns the folder.

    A no-op when the cache already holds it.

    Raises:
        MissingThirdParty: no pinned sha256 for this flax version, or the download differs.
    """
    version = version or flax_version()
    out = cache_dir(version) / "gemma"
    if (out / "transformer.py").is_file():
        return out
    want = FLAX_SDIST_SHA256.get(version)
    if want is None:
        raise MissingThirdParty(
            f"no sha256 pinned for the flax {version} sdist; add it to "
            f"benchmarks/third_party.py FLAX_SDIST_SHA256 (pinned: {sorted(FLAX_SDIST_SHA256)})."
        )
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            + [f"flax=={version}", "-d", tmp],
            check=True,
        )
        (sdist,) = Path(tmp).glob("flax-*.tar.gz")
        got = _sha256(sdist)
        if got != want:
            raise MissingThirdParty(
                f"the flax {version} sdist has sha256 {got}, not the pinned {want}; "
                "refusing to unpack it."
            )
        prefix = f"flax-{version}/examples/gemma/"
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name
                if not (name.startswith(prefix) and name.endswith(".py") and member.isfile()):
                    continue
                rel = name[len(prefix) :]
                if "/" in rel:  # configs/ and benchmarks/: not the model
                    continue
                f = tar.extractfile(member)
                assert f is not None
                (out / rel).write_bytes(f.read())
    return out


if __name__ == "__main__":
    # --if-pinned (make test-latest, on the newest flax): only a flax whose sdist is pinned
    if "--if-pinned" in sys.argv[1:] and flax_version() not in FLAX_SDIST_SHA256:
        print(f"flax {flax_version()}: no pinned sdist sha256; Flax's Gemma tests will skip")
    else:
        print(fetch())
