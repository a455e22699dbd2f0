"""Test set-up: 8 simulated CPU devices, requested before any JAX operation."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# Scripts that tests start as real processes are not test modules (and set up JAX
# their own way at import): keep them out of collection, doctests included.
collect_ignore_glob = ["workers_ckpt/*", "multiprocess/workers/*"]
