"""Worker for failure tests: ``faults.py SCENARIO HEARTBEAT_S [ADDRESS NUM_PROCESSES ID]``.

``HEARTBEAT_S`` ``env`` leaves the heartbeat timeout to ``$DTENSOR_HEARTBEAT_TIMEOUT_S``.

Under dtensor.launch the job comes from the launcher's variables; with the
last three arguments it is joined as separate hosts would (no launcher).
The scenarios:

- ``kill``: process 1 SIGKILLs itself mid-run; the others keep running
  collectives until the runtime notices and stops them.
- ``raise``: process 1 raises after the first steps.
- ``exit3``: process 1 ends with ``sys.exit(3)`` after the first steps.
- ``clean``: every process runs a few steps and ends normally, process 0 a
  few seconds after the others.
- ``loop``: every process runs steps until it is stopped (it prints its pid).
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
import time


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

    heartbeat = None if sys.argv[2] == "env" else float(sys.argv[2])
    if len(sys.argv) > 3:  # as on separate hosts: no launcher
        address, n, pid = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        dtensor.initialize(address, n, pid, heartbeat_timeout_s=heartbeat, timeout_s=60)
    else:
        dtensor.initialize(heartbeat_timeout_s=heartbeat, timeout_s=60)
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
    if scenario == "clean":
        for _ in range(3):
            float(step(x))
        dtensor.barrier("steps-done")
        if me == 0:
            time.sleep(3)  # the others reach the end first and wait for process 0
        print(f"process {me} finished", flush=True)
        if me != 0:
            sys.exit(0)  # an explicit 0 is a normal end too
        return
    if scenario == "loop":
        print(f"process {me} looping pid {os.getpid()}", flush=True)
    for i in range(100_000):
        if scenario == "exit3" and me == 1 and i == 3:
            print("process 1 going away", flush=True)
            sys.exit(3)
        if scenario == "kill_coordinator" and me == 0 and i == 3:
            print("process 0 going away", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario in ("kill", "raise") and me == 1 and i == 3:
            print(f"process 1 going away at {time.time()}", flush=True)
            if scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("process 1 failed on purpose")
        float(step(x))
        if scenario == "loop":
            time.sleep(0.05)
    sys.exit("the loop ended without the failure being noticed")


if __name__ == "__main__":
    main()
