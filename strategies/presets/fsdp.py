"""`FullyShardedStrategy`: ZeRO-3 / FSDP — every large variable split over all devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import dtensor
from dtensor import Layout
from dtensor.core.tree import leaf_value
from strategies.base import Strategy
from strategies.placement.sharding import nbytes, shard_largest_dim
from strategies.reads.mixed_precision import MixedPrecision
from strategies.reads.offload import HOST_MEMORY, check_host_memory
from strategies.reads.param_reads import ReadOptions
from strategies.reads.swaps import check_remat
from strategies.reads.swaps import remat_policy as remat_policy_fn

__all__ = ["FullyShardedStrategy"]


class FullyShardedStrategy(Strategy):
    """ZeRO-3: each variable (and its optimizer state) split on its largest divisible dimension.

    Variables smaller than ``min_shard_bytes`` stay replicated. The batch is
    split over the same ``fsdp`` axis. In a step on Flax NNX modules each
    read of a sharded variable is all-gathered for compute (activations stay
    split by batch) and its gradient is reduce-scattered, whatever XLA's own
    propagation would pick: the step is traced with the ``fsdp`` axis
    Explicit and every such read goes through
    :func:`strategies.reads.fsdp_ops.gather_for_compute`. Steps on plain pytrees
    (Linen, pure JAX) leave the plan to XLA: their parameter reads cannot be
    intercepted.

    ``reshard_after_forward=True`` is the default by the TPU compiler's
    figures (v5e:2x2, AOT): an Adam step of 8 bias-free f32 layers of
    4096x4096 at a global batch of 256 needs 0.144 GiB of temporaries per
    chip with it, 0.477 GiB keeping gathered weights, 0.155 GiB with XLA's
    own plan (``gather_at_read=False``).

    Args:
        devices: the devices (default: all).
        reshard_after_forward: free each gathered weight after its forward
            use and gather it again in the backward pass (each module that
            directly owns a sharded variable is rematerialised, gathers only; one
            with such modules or ``remat=`` blocks below it keeps its own weights
            gathered, so a model's root owning the embedding is never one checkpoint
            around the whole model);
            ``False`` keeps gathered weights for the backward pass. It shapes
            the gather-at-read plan; with ``gather_at_read=False`` XLA's plan
            decides by itself.
        mixed_precision: a :class:`strategies.MixedPrecision`: shards cast to
            ``param_dtype`` before they are gathered, gradients
            reduce-scattered in ``reduce_dtype``, float32 master variables.
        remat: module classes whose calls are recomputed in the backward pass
            (activation checkpointing), their weights gathered again.
        remat_policy: what those calls save: ``None`` (their inputs only), a
            ``jax.checkpoint_policies`` name (``"dots_saveable"``...) or a
            policy callable.
        offload_optimizer: keep optimizer state (paths under ``opt_state``)
            in host memory (``pinned_host``) between steps.
        min_shard_bytes: variables smaller than this stay replicated.
        gather_layers: under XLA's plan (``gather_at_read=False``) with
            ``remat=``: each layer of a scanned stack (``nnx.scan``) is
            gathered whole inside the loop body after its cast (a sharding
            constraint; its gradient constrained back to the layer's split),
            as MaxText's scanned layers are, instead of XLA casting whole
            stacked kernels ahead of the loop. Measured (AOT, AdamW, bf16 +
            remat + scan, ``benchmarks/results/fsdp_scale.json``): it lowers
            Llama 2 70B on v5p:4x4x4 and raises a Gemma-7B-shaped decoder's
            collectives on v5e:4x4, so it is off by default;
            ``python -m dtensor.aot --fit`` tries it as a rung that may run
            faster once its search reaches the scanned rungs, keeping the
            lower step-time floor.
        gather_at_read: ``True`` gathers each sharded weight where it is read
            (reduce-scattered gradient, reshard and remat as above); ``False``
            leaves the plan to XLA's SPMD partitioner. ``None`` (the default)
            chooses by platform: ``True`` on CPU, whose compiler never forms a
            reduce-scatter by itself (it would all-reduce full-size
            gradients); ``False`` on TPU and GPU, whose compilers form
            reduce-scatters and plan memory better by themselves: a
            Gemma-2B-shaped decoder (AdamW, batch 16 x 1024, v5e:4x4, AOT)
            peaks at 8.2 GiB per chip with XLA's plan against 16.3 GiB with
            gathers at reads (``benchmarks/results/fsdp_scale.json``); on
            h100:1x8 (XLA:GPU, ahead of time) 28.2 against 28.3 GiB, with
            13.4 against 24.5 GiB of communication per GPU
            (``benchmarks/results/fsdp_scale_gpu.json``).

    Examples:
        >>> import strategies, jax.numpy as jnp
        >>> s = strategies.FullyShardedStrategy(min_shard_bytes=1024)
        >>> s.variable_layout("dense/kernel", jnp.zeros((64, 256)))
        Layout([UNSHARDED, 'fsdp'], mesh=Mesh(fsdp=8))
        >>> s.variable_layout("dense/bias", jnp.zeros((64,))).is_fully_replicated()
        True
        >>> from flax import nnx
        >>> s = strategies.FullyShardedStrategy(
        ...     mixed_precision=strategies.MixedPrecision(), remat=(nnx.Linear,), remat_policy="dots_saveable"
        ... )
        >>> s.reshard_after_forward, s.mixed_precision.param_dtype
        (True, dtype(bfloat16))
    """

    name = "fully_sharded"
    shards_variables = True

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        *,
        reshard_after_forward: bool = True,
        mixed_precision: MixedPrecision | None = None,
        remat: Sequence[type] | None = None,
        remat_policy: Any = None,
        offload_optimizer: bool = False,
        min_shard_bytes: int = 16 << 10,
        gather_at_read: bool | None = None,
        gather_layers: bool = False,
    ) -> None:
        if min_shard_bytes < 0:
            raise ValueError(
                f"min_shard_bytes={min_shard_bytes} is negative; use 0 to shard every variable."
            )
        self.min_shard_bytes = min_shard_bytes
        devices = list(devices) if devices is not None else jax.devices()
        if gather_at_read is None:  # by the compiler of the platform the step runs on
            gather_at_read = devices[0].platform == "cpu"
        self.gather_at_read = bool(gather_at_read)
        self.gather_layers = bool(gather_layers)
        if self.gather_layers and (self.gather_at_read or not remat):
            raise ValueError(
                f"FullyShardedStrategy(gather_layers=True) shapes XLA's plan for scanned layers "
                f"under remat=, but got gather_at_read={self.gather_at_read} (on "
                f"{devices[0].platform}) and remat={remat!r}. Pass gather_at_read=False and "
                "remat=(YourBlock,), or drop gather_layers (gathers at reads already gather "
                "each layer)."
            )
        self.reshard_after_forward = bool(reshard_after_forward)
        self.remat = check_remat(remat)
        self.remat_policy = remat_policy
        self._policy = remat_policy_fn(remat_policy)
        self.offload_optimizer = bool(offload_optimizer)
        if self.offload_optimizer:
            check_host_memory(devices, "FullyShardedStrategy(offload_optimizer=True)")
        super().__init__(
            dtensor.create_mesh([("fsdp", len(devices))], devices=devices),
            batch_axes=("fsdp",),
            mixed_precision=mixed_precision,
        )

    def variable_layout(self, path: str, leaf: Any) -> Layout:
        shape = np.shape(leaf_value(leaf))
        specs: list[Any] = [None] * len(shape)
        if nbytes(leaf) >= self.min_shard_bytes:
            specs = shard_largest_dim(specs, shape, "fsdp", self.mesh.shape["fsdp"])
        return Layout(specs, self.mesh)

    def memory_kind(self, path: str, leaf: Any) -> str | None:
        """``"pinned_host"`` for optimizer state with ``offload_optimizer=True``."""
        if self.offload_optimizer and "opt_state" in path.split("/"):
            return HOST_MEMORY
        return None

    def read_options(self) -> ReadOptions:
        """Gather at reads (unless ``gather_at_read=False``), reshard, remat, casts."""
        return ReadOptions(
            axes=self.batch_axes,
            gather=self.gather_at_read,
            # XLA's own plan decides by itself what to keep (measured on a 2b decoder,
            # v5e:4x4: 8.2 GiB per chip as is, 8.9 GiB with the reshard wrappers).
            reshard_after_forward=self.reshard_after_forward and self.gather_at_read,
            remat=self.remat,
            remat_policy=self._policy,
            mixed_precision=self.mixed_precision,
            batch_axes=() if self.gather_at_read else self.batch_axes,
            layer_gather=self.gather_layers,
            # ... and without remat= each layer of a scanned stack keeps the batch split too
            layer_batch_split=not self.gather_at_read and not self.remat,
        )
