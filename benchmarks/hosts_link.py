"""Two hosts joined by a slow link, against one host: MultiWorkerMirrored and parameter servers.

The hosts are Linux network namespaces on this machine (``tests/hosts.py``: a
veth pair, one address and host name each; needs root and iproute2). The
link is limited with a token-bucket filter (``tc qdisc ... tbf rate 1gbit``,
on both ends) as a slow data-center network would be. Three placements of
the same jobs:

- ``one host``: every process on hosta;
- ``two hosts``: half the processes on each, the link unlimited (veth);
- ``two hosts, 1 Gbit/s``: the same with the tbf on the link.

Measured: ``MultiWorkerMirroredStrategy`` seconds per step (2 processes, 1
device each, :mod:`benchmarks.hosts_job`) and a ``ParameterServerStrategy``
job's closures per second (chief and ps on hosta, 2 workers on hostb,
:mod:`benchmarks.coordinator_job`). Beside them, what the bytes predict for
the link: the step's collective bytes per device from ``strategy.explain``
(ring model) over the link rate, and the link rate over the bytes each
closure moves.

Run (as root): ``JAX_PLATFORMS=cpu python -m benchmarks.hosts_link`` (writes
``benchmarks/results/hosts_link.json`` and prints a table). On the shared
2-core machine compute competes with the link for the same cores; the
figures are this machine's, not a cluster's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import common

RATE_BITS = 1e9
REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTENSOR_", "TF_CONFIG"))}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def _result(done: list[tuple[int, str]], label: str) -> dict[str, Any]:
    if any(rc != 0 for rc, _ in done):
        report = "\n".join(f"--- status {rc}\n{out[-3000:]}" for rc, out in done)
        raise SystemExit(f"the {label} job failed:\n{report}")
    line = next(ln for ln in done[0][1].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _mwms(hosts: Any, placement: tuple[int, int], port: int, args: list[str]) -> dict[str, Any]:
    from tests.hosts import finish

    workers = [f"{hosts.names[h]}:{port + i}" for i, h in enumerate(placement)]
    procs = []
    for i, h in enumerate(placement):
        config = json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
        )
        argv = [sys.executable, "-m", "benchmarks.hosts_job", *args]
        procs.append(hosts.popen(h, argv, _env(TF_CONFIG=config), cwd=str(REPO)))
    return _result(finish(procs, 400), "MultiWorkerMirrored")


def _ps(hosts: Any, placement: tuple[int, ...], port: int, closures: int) -> dict[str, Any]:
    from tests.hosts import finish

    names = [f"{hosts.names[h]}:{port + i}" for i, h in enumerate(placement)]
    cluster = {"chief": names[:1], "ps": names[1:2], "worker": names[2:]}
    tasks = [("chief", 0), ("ps", 0)] + [("worker", i) for i in range(len(names) - 2)]
    procs = []
    for (kind, index), h in zip(tasks, placement, strict=True):
        config = json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})
        argv = [sys.executable, "-m", "benchmarks.coordinator_job", "--closures", str(closures)]
        procs.append(hosts.popen(h, argv, _env(TF_CONFIG=config), cwd=str(REPO)))
    return _result(finish(procs, 400), "parameter-server")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--closures", type=int, default=60)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from tests.hosts import two_hosts

    job = [
        "--hidden",
        str(args.hidden),
        "--features",
        str(args.features),
        "--steps",
        str(args.steps),
    ]
    rows: list[dict[str, Any]] = []
    port = 48000
    with two_hosts() as hosts:
        placements = [
            ("one host", (0, 0), (0, 0, 0, 0), False),
            ("two hosts", (0, 1), (0, 0, 1, 1), False),
            ("two hosts, 1 Gbit/s", (0, 1), (0, 0, 1, 1), True),
        ]
        for label, mwms_at, ps_at, slow in placements:
            if slow:
                hosts.limit(rate="1gbit", burst="1mb", latency="50ms")
            start = time.perf_counter()
            mw = _mwms(hosts, mwms_at, port, job)
            ps = _ps(hosts, ps_at, port + 10, args.closures)
            port += 20
            link_s = mw["comm_bytes_per_device"] * 8 / RATE_BITS
            rows.append(
                {
                    "placement": label,
                    "mwms_step_s": mw["step_s"],
                    "mwms_comm_bytes_per_device": mw["comm_bytes_per_device"],
                    "mwms_link_s_predicted": link_s,
                    "ps_closures_per_s": ps["closures_per_s"],
                    "ps_bytes_per_closure": ps["bytes_per_closure"],
                    "ps_closures_per_s_link_bound": RATE_BITS / 8 / ps["bytes_per_closure"],
                    "wall_s": time.perf_counter() - start,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    payload = {
        "config": {
            "model": f"MLP {args.features}->{args.hidden}->{args.features}, Adam, batch 32",
            "mwms_processes": 2,
            "ps_job": "chief + 1 ps (FixedShardsPartitioner(2)) + 2 workers, 1 device each",
            "closures": args.closures,
            "link": "veth pair between two network namespaces; tbf rate 1gbit burst 1mb latency 50ms",
            "rate_bits_per_s": RATE_BITS,
        },
        "results": rows,
    }
    out = (args.out / "hosts_link.json") if args.out else common.RESULTS / "hosts_link.json"
    common.write_json("hosts_link", payload, out.parent)
    common.print_table(
        "Two hosts over a slow link (namespaces on one machine)",
        ["placement", "MWMS s/step", "link s/step (bytes / 1 Gbit/s)", "PS closures/s",
         "link-bound closures/s", "bytes/closure"],
        [
            [r["placement"], r["mwms_step_s"], r["mwms_link_s_predicted"], r["ps_closures_per_s"],
             r["ps_closures_per_s_link_bound"], int(r["ps_bytes_per_closure"])]
            for r in rows
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
