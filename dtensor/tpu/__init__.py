"""TPU topologies without a TPU, and ahead-of-time compiles of a training script for them."""
