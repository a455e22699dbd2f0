"""Fail unless each named package is installed at the newest release the index offers this Python.

    python .ci/check_newest.py jax jaxlib flax optax orbax-checkpoint

`make test-latest` runs it in `.venv-latest` after installing: a resolver that held a
package back (a stale cache, a pin elsewhere, an index that lags) would otherwise run
the suite on an older release and call it the newest. It asks the package index pip
is configured with (`pip index versions`, pre-releases excluded, wheels for this
interpreter only), nothing else.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version


def newest_listed(pip_output: str) -> str | None:
    """The newest release in ``pip index versions`` output (its list is newest first).

    Examples:
        >>> newest_listed("jax (0.10.2)\\nAvailable versions: 0.10.2, 0.10.1\\n  INSTALLED: 0.10.1")
        '0.10.2'
        >>> newest_listed("ERROR: No matching distribution found for nothing") is None
        True
    """
    m = re.search(r"^Available versions:\s*([^,\s]+)", pip_output, flags=re.M)
    return m.group(1) if m else None


def stale(installed: dict[str, str | None], newest: dict[str, str | None]) -> list[str]:
    """One line for each package not installed at its newest release (empty: all newest).

    Examples:
        >>> stale({"jax": "0.12.0.1", "flax": "0.12.8"}, {"jax": "0.12.0.1", "flax": "0.12.12"})
        ['flax 0.12.8 is installed, but the newest release is 0.12.12']
    """
    out = []
    for name, have in installed.items():
        want = newest.get(name)
        if want is None:
            out.append(f"{name}: the index lists no release for this Python")
        elif have is None:
            out.append(f"{name} is not installed (the newest release is {want})")
        elif have != want:
            out.append(f"{name} {have} is installed, but the newest release is {want}")
    return out


def main(names: list[str]) -> int:
    installed: dict[str, str | None] = {}
    newest: dict[str, str | None] = {}
    for name in names:
        try:
            installed[name] = version(name)
        except PackageNotFoundError:
            installed[name] = None
        cmd = [sys.executable, "-m", "pip", "index", "versions", name]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        newest[name] = newest_listed(done.stdout)
    problems = stale(installed, newest)
    py = ".".join(map(str, sys.version_info[:3]))
    if problems:
        print(f"check_newest (Python {py}): NOT the newest releases:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        print(
            "  Rebuild the venv (rm -rf .venv-latest; make test-latest), or look for what holds "
            "the package back (pip install --upgrade --dry-run NAME).",
            file=sys.stderr,
        )
        return 1
    listed = ", ".join(f"{n} {v}" for n, v in installed.items())
    print(f"check_newest (Python {py}): the newest releases: {listed}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
