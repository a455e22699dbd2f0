"""NVIDIA GPU topologies without a GPU (XLA:GPU target configs), for ahead-of-time compiles."""
