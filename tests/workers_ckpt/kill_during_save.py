"""Save step 1, start an async save of a large step 2, and SIGKILL this process mid-write.

Usage: kill_during_save.py CKPT_DIR

Step 1 holds {"w": arange(16)}; step 2 adds a 256 MB array, so its background
write is still running when the process kills itself right after save()
returns (the tests then check that step 1 is what restores).
"""

import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dtensor import checkpoint  # noqa: E402


def main() -> None:
    ckpt = checkpoint.Checkpointer(sys.argv[1], async_save=True)
    ckpt.save(1, {"w": jnp.arange(16.0)})
    ckpt.wait()
    # Random (incompressible) values, drawn by numpy: jax.random at XLA's -O0 (tests/conftest.py)
    # takes seconds of CPU for 64M of them.
    big = jax.device_put(np.random.default_rng(0).random(64 * 1024 * 1024, dtype=np.float32))
    big.block_until_ready()
    ckpt.save(2, {"w": jnp.arange(16.0) + 1, "big": big})
    print("SAVING", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
