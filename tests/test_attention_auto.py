"""``dtensor.context_attention(implementation="auto")``: the platform's kernel, as the decoder's.

On a deviceless H100 topology (:func:`dtensor.gpu_topology`, XLA:GPU's compiler on this CPU
machine) ``"auto"`` is cuDNN's fused attention in bfloat16/float16, and the compiled program
calls it; ``"cudnn"`` asked for a call it cannot take is refused with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dtensor
from dtensor.core.attention import best_implementation


@pytest.fixture(scope="module")
def h100() -> dtensor.Mesh:
    return dtensor.create_mesh([("data", 8)], devices=dtensor.gpu_topology("h100:1x8"))


def _sds(mesh: dtensor.Mesh, heads: int, dtype=jnp.bfloat16, head_dim: int = 128):
    sharding = NamedSharding(mesh.jax_mesh, P("data"))
    return jax.ShapeDtypeStruct((8, 512, heads, head_dim), dtype, sharding=sharding)


def test_auto_is_cudnn_on_nvidia_gpus_in_half_precision(h100):
    q = _sds(h100, 4)
    assert best_implementation(q, q, causal=True, mesh=h100) == "cudnn"
    assert best_implementation(_sds(h100, 4, jnp.float16), q, mesh=h100) == "cudnn"
    assert best_implementation(_sds(h100, 4, jnp.float32), q, mesh=h100) == "xla"
    assert best_implementation(_sds(h100, 4, head_dim=256), q, mesh=h100) == "xla"
    assert best_implementation(q, q, mask=jnp.ones((1, 1), bool), mesh=h100) == "xla"
    context = dtensor.create_mesh(
        [("fsdp", 2), ("context", 4)], devices=dtensor.gpu_topology("h100:1x8")
    )
    assert best_implementation(q, q, causal=True, mesh=context) == "xla"
    cpu = dtensor.create_mesh([("data", 8)])
    assert best_implementation(q, q, causal=True, mesh=cpu) == "xla"


def test_auto_compiles_to_cudnn_s_fused_attention_on_h100(h100):
    """Forward and backward, grouped-query heads, compiled for h100:1x8 with no GPU."""
    q, kv = _sds(h100, 4), _sds(h100, 2)

    def loss(q, k, v):
        out = dtensor.context_attention(q, k, v, causal=True, implementation="auto")
        return out.astype(jnp.float32).sum()

    with h100:
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        xla = (
            jax.jit(
                lambda q, k, v: dtensor.context_attention(
                    q, k, v, causal=True, implementation="xla"
                )
            )
            .lower(q, kv, kv)
            .compile()
        )
    assert "__cudnn$fmha" in compiled.as_text()
    assert "__cudnn$fmha" not in xla.as_text()


def test_cudnn_refuses_what_it_cannot_take(h100):
    q = jnp.ones((1, 128, 2, 16), jnp.float32)
    with pytest.raises(
        ValueError, match=r"implementation='cudnn'.*bfloat16 or float16, not float32"
    ):
        dtensor.context_attention(q, q, q, implementation="cudnn")
    context = dtensor.create_mesh([("context", 8)])
    half = q.astype(jnp.bfloat16)
    with context, pytest.raises(ValueError, match=r"no per-shard path under a context axis"):
        dtensor.context_attention(half, half, half, implementation="cudnn")
