"""Test set-up: 8 simulated CPU devices, requested before any JAX operation."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
