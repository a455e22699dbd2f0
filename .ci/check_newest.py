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


def blocker(pip_output: str) -> str | None:
    """What a failed ``pip install --dry-run`` could not find (``None``: it did not say).

    Examples:
        >>> blocker("ERROR: No matching distribution found for libtpu==0.0.53.* (from jax[tpu])")
        'libtpu==0.0.53.* (from jax[tpu])'
    """
    m = re.search(r"No matching distribution found for (.+)$", pip_output, flags=re.M)
    return m.group(1).strip() if m else None


def jax_held_back_by(newest_jax: str) -> str | None:
    """Why ``jax[tpu]==newest_jax`` cannot be installed (``None``: it can).

    The suite needs jax's ``tpu`` extra (libtpu, for the ahead-of-time TPU compiles), and
    a jax release pins the libtpu built with it, which can reach the index days later:
    until then the newest jax this project installs is the one before.
    """
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet"]
    done = subprocess.run([*cmd, f"jax[tpu]=={newest_jax}"], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    if done.returncode == 0:
        return None
    return blocker(done.stdout + done.stderr) or "a requirement pip could not resolve"


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
    jax_stale = [n for n in ("jax", "jaxlib") if n in installed and installed[n] != newest.get(n)]
    reason = jax_held_back_by(newest["jax"]) if jax_stale and newest.get("jax") else None
    if reason is not None:
        # jax's newest release needs a libtpu the index does not offer yet: the installed
        # jax is the newest this project can be installed at today.
        held = [line for line in problems if line.split()[0] in jax_stale]
        problems = [line for line in problems if line not in held]
        print(f"check_newest (Python {py}): jax held back ({reason} is not on the index):")
        for line in held:
            print(f"  {line}")
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
    newest_of = "the newest installable releases" if reason else "the newest releases"
    print(f"check_newest (Python {py}): {newest_of}: {listed}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
