"""The attention kernels beside XLA's einsums, and the choice among them.

:func:`best_implementation` is what ``implementation="auto"`` of
:func:`dtensor.context_attention` (and ``examples/decoder.py``'s ``attention="auto"``)
stands for on the platform a step is traced for (:func:`trace_platform`, the mesh's, so an
ahead-of-time compile for a TPU or GPU topology on a CPU machine gets that platform's):
:func:`splash_attention` (the Pallas splash kernel that ships with jax) on TPU,
:func:`cudnn_attention` (cuDNN's fused attention) on NVIDIA GPUs, else XLA's einsums
(:mod:`dtensor.core.attention_xla`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dtensor.core.attention_xla import (
    current_mode,
    gather_sequence,
    ulysses_heads,
    ulysses_repeats,
    ulysses_rows,
)

__all__ = [
    "best_implementation",
    "cudnn_attention",
    "cudnn_problem",
    "mesh_text",
    "splash_attention",
    "trace_mesh",
    "trace_platform",
]

#: The dtypes cuDNN's fused attention takes.
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def trace_platform(mesh: Any = None) -> str:
    """The platform (``"cpu"``, ``"gpu"``, ``"tpu"``) a traced step is compiled for: that of
    ``mesh`` (default: the trace's mesh, dtensor's ``with mesh:`` or JAX's abstract mesh,
    which keeps its devices' platform), else JAX's default backend. Ahead-of-time compiles
    for a TPU or GPU topology trace on a CPU machine: the mesh, not the backend, says which.

    Examples:
        >>> import dtensor
        >>> from dtensor.core.attention import trace_platform
        >>> trace_platform(dtensor.create_mesh([("x", 8)]))
        'cpu'
        >>> trace_platform(dtensor.create_mesh([("x", 8)], devices=dtensor.tpu_topology("v5e:2x4")))
        'tpu'
    """
    from dtensor.core.experts import _platform

    return _platform(trace_mesh() if mesh is None else mesh)


def best_implementation(
    query: Any,
    key: Any,
    causal: bool = True,
    mask: Any = None,
    window: Any = None,
    mode: str | None = None,
    mesh: Any = None,
    context: int | None = None,
) -> str:
    """The :func:`context_attention` implementation ``"auto"`` stands for: ``"splash"`` on TPU
    when the kernel takes the call (no ``mask`` or ``window``; ``"gather"`` mode under a
    ``context`` axis; each device's queries and all the keys in whole blocks of 128),
    ``"cudnn"`` on NVIDIA GPUs when cuDNN's fused attention takes it (bfloat16 or float16, no
    ``context`` axis, no ``mask`` or ``window``, a head dimension that is a multiple of 8 and
    at most 128), else ``"xla"``. ``examples/decoder.py``'s ``attention="auto"`` is this choice.

    Examples:
        >>> import jax, jax.numpy as jnp, dtensor
        >>> from dtensor.core.attention import best_implementation
        >>> q = jax.ShapeDtypeStruct((8, 1024, 4, 128), jnp.bfloat16)
        >>> tpu = dtensor.create_mesh([("data", 8)], devices=dtensor.tpu_topology("v5e:2x4"))
        >>> best_implementation(q, q, causal=True, mesh=tpu)
        'splash'
        >>> gpu = dtensor.create_mesh([("data", 8)], devices=dtensor.gpu_topology("h100:1x8"))
        >>> best_implementation(q, q, causal=True, mesh=gpu)
        'cudnn'
        >>> best_implementation(q, q, causal=True, mesh=dtensor.create_mesh([("data", 8)]))
        'xla'
    """
    mesh = trace_mesh() if mesh is None else mesh
    if context is None:
        context = int(mesh.shape.get("context", 1)) if mesh is not None else 1
    mode = current_mode() if mode is None else mode
    q_len, kv_len, c = query.shape[1], key.shape[1], int(context)
    platform = trace_platform(mesh)
    if platform == "tpu":
        shards = 1 if mode == "ulysses" else c  # Ulysses: each device all the queries
        fits = q_len % (128 * shards) == 0 and kv_len % 128 == 0 and (q_len == kv_len or not causal)
        takes = mask is None and window is None and (c == 1 or mode in ("gather", "ulysses"))
        return "splash" if fits and takes else "xla"
    if platform in ("gpu", "cuda") and cudnn_problem(query, mask, window, c) is None:
        return "cudnn"
    return "xla"


def cudnn_problem(query: Any, mask: Any, window: Any, context: int) -> str | None:
    """Why cuDNN's fused attention cannot take the call (``None``: it can)."""
    head_dim = query.shape[-1]
    if jnp.dtype(query.dtype) not in _CUDNN_DTYPES:
        return f"it takes bfloat16 or float16, not {jnp.dtype(query.dtype).name}"
    if context > 1:
        return f"it has no per-shard path under a context axis (of size {context})"
    if mask is not None or window is not None:
        return "its path here takes no mask= or window="
    if head_dim % 8 or head_dim > 128:
        return f"its head dimension must be a multiple of 8 and at most 128, not {head_dim}"
    return None


def cudnn_attention(query, key, value, causal, mask, window, scale, mesh, c):
    """cuDNN's fused attention on the arrays as they are laid out (no ``context`` axis)."""
    problem = cudnn_problem(query, mask, window, c)
    if problem is not None:
        where = mesh_text(mesh) if mesh is not None else "no mesh"
        raise ValueError(
            f"dtensor.context_attention(implementation='cudnn') on {where}: {problem}. Use "
            "implementation='auto' (cuDNN where it takes the call, else XLA) or 'xla'."
        )
    return jax.nn.dot_product_attention(
        query, key, value, scale=scale, is_causal=causal, implementation="cudnn"
    )


def splash_attention(q, k, v, causal, mask, window, scale, mode, mesh, axis, spec):
    """The splash kernel on each device's queries against all keys (gathered over ``axis``
    under a context axis; the device's own otherwise)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from jax.sharding import NamedSharding

    c = mesh.shape[axis] if mesh is not None and axis in mesh.axis_names else 1
    if (c > 1 and mode not in ("gather", "ulysses")) or mask is not None or window is not None:
        raise ValueError(
            "dtensor.context_attention(implementation='splash') takes mode='gather' or "
            "'ulysses' without mask= or window= (got mode="
            f"{mode!r}, mask {'given' if mask is not None else 'None'}, "
            f"window {'given' if window is not None else 'None'}); use implementation='xla'."
        )
    b, s, h, d = q.shape
    kvh = k.shape[2]
    # Ulysses: each device the whole sequence of its heads / c heads (the KV heads repeated
    # where fewer), the kernel on all of it; gather: its S / c queries against all keys.
    ulysses = c > 1 and mode == "ulysses"
    shards = c if c > 1 and not ulysses else 1
    if ulysses and mesh is not None:
        t = mesh.shape[spec[2]] if spec[2] else 1
        kvh *= ulysses_repeats(kvh // t, c)
    block_q, block_kv = min(512, s // shards), min(512, s)
    sizes = sk.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
        # Separate dq and dk/dv kernels: the fused backward writes a partial dq per key block
        # (kv_len / block_kv copies of q: 16 GiB a chip for llama3.1-8b at 32768 tokens).
        use_fused_bwd_kernel=False,
    )
    one = sm.CausalMask((s, s)) if causal else sm.FullMask((s, s))
    kernel = sk.make_splash_mqa(
        sm.MultiHeadMask([one] * (h // kvh)), block_sizes=sizes, head_shards=1, q_seq_shards=shards
    )

    def per_device(kernel, q, k, v):
        if ulysses:
            q, k, v = ulysses_heads(q, k, v, c, axis)
        elif c > 1:
            k, v = gather_sequence(k, axis), gather_sequence(v, axis)
        bl, n = q.shape[:2]
        hl = k.shape[2]  # this device's key/value heads, each with its group of query heads
        qh = (q * jnp.asarray(scale, q.dtype)).reshape(bl, n, hl, q.shape[2] // hl, d)
        qh = qh.transpose(0, 2, 3, 1, 4)  # (batch, kv_heads, group, n, d)
        kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

        def call(kernel, q, k, v):
            return kernel(q, k, v)

        out = jax.vmap(jax.vmap(call, (None, 0, 0, 0)), (None, 0, 0, 0))(kernel, qh, kh, vh)
        out = out.transpose(0, 3, 1, 2, 4).reshape(bl, n, q.shape[2], d)
        return ulysses_rows(out, axis) if ulysses else out

    if mesh is None or mesh.size == 1:
        return per_device(kernel, q, k, v)
    kernel_spec = kernel.manual_sharding_spec(
        NamedSharding(mesh, P(None, axis if shards > 1 else None))
    )
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(kernel_spec, spec, spec, spec),
        out_specs=spec,
        check_vma=False,
    )(kernel, q, k, v)


def trace_mesh() -> Any:
    """The mesh a step is traced under (dtensor's ``with mesh:`` or JAX's abstract mesh), or
    ``None``."""
    from dtensor.core.experts import _mesh as mesh

    return mesh()


def mesh_text(mesh: Any) -> str:
    return "mesh " + ", ".join(f"{a}={s}" for a, s in mesh.shape.items())
