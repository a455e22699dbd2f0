"""Small real Flax models shared by the tests: an MLP and a transformer block."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

VOCAB, D, HEADS, MLP, SEQ = 64, 32, 4, 64, 8


class MLPModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, din: int = 16, dh: int = 64, dout: int = 8):
        self.up = nnx.Linear(din, dh, rngs=rngs)
        self.down = nnx.Linear(dh, dout, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


class Block(nnx.Module):
    """Embedding, layer norm, self-attention, MLP, head: a tiny transformer LM."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        # No q/k/v biases: the key bias's gradient is identically zero (softmax is
        # shift-invariant), so Adam would turn float noise into visible updates.
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=D, qkv_features=D, decode=False, use_bias=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, MLP, rngs=rngs)
        self.down = nnx.Linear(MLP, D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        h = h + self.attn(self.ln1(h), mask=mask)
        h = h + self.down(jax.nn.gelu(self.up(self.ln2(h))))
        return self.head(h)


def mlp_batches(steps: int = 5, batch: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(batch, 16)).astype(np.float32),
            "y": rng.normal(size=(batch, 8)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def lm_batches(steps: int = 5, batch: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        t = rng.integers(0, VOCAB, size=(batch, SEQ + 1)).astype(np.int32)
        out.append({"x": t[:, :-1], "y": t[:, 1:]})
    return out


def mlp_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def lm_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_train_step(loss_fn):
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return train_step


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64, name="up")(x)
        return nn.Dense(8, name="down")(jax.nn.relu(x))


def linen_step(tx):
    model = LinenMLP()

    def step(params, opt_state, batch):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return model, step


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def deep_mlp_step(layers: int, width: int = 16384):
    """An abstract deep MLP (``layers`` square float32 kernels) with Adam, its step and batch:
    ``(step, (model, optimizer, batch))`` for ahead-of-time compiles too large for a device."""

    class Deep(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [nnx.Linear(width, width, use_bias=False, rngs=rngs) for _ in range(layers)]
            )

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    def build():
        model = Deep(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(build)
    batch = {k: jax.ShapeDtypeStruct((64, width), jnp.float32) for k in ("x", "y")}
    step = make_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
    return step, (model, optimizer, batch)


def abstract_block_step(batch: int = 64):
    """The transformer :class:`Block` with Adam, built abstractly, its LM step and a token batch:
    ``(step, (model, optimizer, batch))`` for ahead-of-time compiles on TPU/GPU topologies."""

    def build():
        model = Block(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(build)
    tokens = {k: jax.ShapeDtypeStruct((batch, SEQ), jnp.int32) for k in ("x", "y")}
    return make_train_step(lm_loss), (model, optimizer, tokens)
