"""Worker for failure tests. argv[1] is the scenario:

- ``kill``: process 1 SIGKILLs itself mid-run; the others keep running
  collectives until the runtime notices and stops them.
- ``raise``: process 1 raises after the first steps.
- ``kill_coordinator``: process 0 (which runs the coordination service)
  SIGKILLs itself mid-run.
- ``wrong_address``: join a coordinator where nothing listens (as process 1).
- ``alone``: be process 0 of 2 with no process 1 ever started.
- ``busy_port``: be process 0 with a coordinator port another socket holds.
"""

from __future__ import annotations

import os
import signal
import sys


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    scenario = sys.argv[1]
    import dtensor

    if scenario == "wrong_address":
        address = f"127.0.0.1:{closed_port()}"
        try:
            dtensor.initialize(address, 2, 1, timeout_s=3)
        except dtensor.DistributedRuntimeError as e:
            print(f"CAUGHT {e}", flush=True)
            sys.exit(0)
        sys.exit("initialize did not fail")
    if scenario == "busy_port":
        import socket

        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            s.listen()
            try:
                dtensor.initialize(f"127.0.0.1:{s.getsockname()[1]}", 1, 0, timeout_s=5)
            except dtensor.DistributedRuntimeError as e:
                print(f"CAUGHT {e}", flush=True)
                sys.exit(0)
        sys.exit("initialize did not fail")
    if scenario == "alone":
        dtensor.initialize(f"127.0.0.1:{closed_port()}", 2, 0, timeout_s=3)
        sys.exit("initialize did not fail")

    dtensor.initialize(heartbeat_timeout_s=float(sys.argv[2]), timeout_s=60)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    me = dtensor.client_id()
    mesh = dtensor.create_mesh([("batch", len(jax.devices()))])
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh.jax_mesh, P("batch")),
        np.ones((len(jax.local_devices()),), np.float32),
    )
    step = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh.jax_mesh, P()))
    dtensor.barrier("start")
    for i in range(100_000):
        if scenario == "kill_coordinator" and me == 0 and i == 3:
            print("process 0 going away", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario != "kill_coordinator" and me == 1 and i == 3:
            print("process 1 going away", flush=True)
            if scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("process 1 failed on purpose")
        float(step(x))
    sys.exit("the loop ended without the failure being noticed")


if __name__ == "__main__":
    main()
