"""Six parallelisms, one preset: HybridStrategy's stage, context and expert axes together.

Each axis has its own tests (tests/test_pipeline.py, tests/test_context.py,
tests/test_experts.py); here they compose. The example decoder trains under
``stage`` with ``expert`` (an MoE block, whose load-balancing loss the pipeline
accumulates per microbatch) and with ``context`` (attention over sequence
shards inside each pipeline tick), scanned and as a list of blocks, against
plain single-device JAX (float32: losses to 1e-5, every parameter to 1e-5 in
norm after three steps); and all six axes at 2 each (64 simulated devices, in a
process of its own).

The optimizer is Adam with ``eps=1e-3``: with a small ``eps`` Adam divides each
gradient element by its own size, so an element whose gradient is about ``eps``
turns float32 rounding of the sums (1e-8 here, where the sequence or the heads
are split the sums run in another order) into 1e-4 of its update; measured on
``tensor=2 x context=2`` without any pipeline, where the gradients themselves
match single-device JAX to 1e-8.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import strategies
from dtensor.core.attention import CONTEXT_SCOPE
from examples.decoder import CONFIGS, Block, loss_fn
from tests import signatures, test_decoder
from tests.test_decoder import _batches, _step
from tests.test_pipeline import _close

REPO = Path(__file__).resolve().parent.parent


_build = functools.partial(test_decoder._build, eps=1e-3)


def _micro_aux_loss(microbatches):
    """The decoder's loss with its MoE loss taken per microbatch (rows ``m, m + M, ...``)
    and averaged, as a pipeline of ``M`` microbatches computes it; on one device. The model
    runs once over the microbatches (``nnx.vmap``, one copy of the layers in the program):
    the mean of their cross-entropies is the whole batch's (microbatches of equal size)."""

    def loss(model, batch):
        def split(a):  # [B, ...] -> [M, B / M, ...], microbatch m holding rows m, m + M, ...
            return a.reshape(-1, microbatches, *a.shape[1:]).swapaxes(0, 1)

        run = nnx.vmap(lambda m, x: m(x, with_aux=True), in_axes=(None, 0))
        logits, aux = run(model, split(batch["x"]))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, split(batch["y"])).mean()
        return ce + model.cfg.aux_loss_weight * aux.mean()

    def step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value

    return step


def _one_device(cfg, batches, step=_step):
    model, opt = _build(cfg)
    jitted = nnx.jit(step)
    return [float(jitted(model, opt, b)) for b in batches], nnx.state(model, nnx.Param)


def _staged(cfg, batches, **kw):
    s = strategies.HybridStrategy(pipeline=(Block,), min_shard_bytes=0, **kw)
    with s.scope():
        model, opt = _build(cfg)
    return [float(s.run(_step, args=(model, opt, b))) for b in batches], model, s, opt


@pytest.mark.parametrize("layers", ["scan", "list"])
def test_moe_decoder_trains_in_stages_as_on_one_device(layers):
    """stage=2 x expert=2 x data=2: the experts split over ``expert`` inside each stage;
    the load-balancing loss of each microbatch added up over the layers, then averaged."""
    cfg = CONFIGS["tiny-moe"].replace(layers=4, scan=layers == "scan")
    batches = _batches(cfg, batch=16)
    want, want_params = _one_device(cfg, batches, _micro_aux_loss(4))
    got, model, *_ = _staged(cfg, batches, data=2, stage=2, expert=2, microbatches=4)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params)
    # Not the whole batch's load-balancing loss (a product of two means over the batch): the
    # first step's loss is the loss at the initial parameters, a forward pass on one device.
    whole = float(nnx.jit(loss_fn)(_build(cfg)[0], batches[0]))
    assert abs(got[0] - whole) > 1e-5 * abs(whole)


@pytest.mark.parametrize(
    "layers, mode", [("scan", "gather"), ("list", "ring"), ("scan", "ring"), ("list", "gather")]
)
def test_decoder_with_context_trains_in_stages_as_on_one_device(layers, mode):
    """stage=2 x context=2 x fsdp=2: each tick's attention over the sequence shards, by the
    mode's exchange inside the stages (tests/signatures.py; the two modes give the same
    numbers, so the program tells them apart)."""
    cfg = CONFIGS["tiny"].replace(layers=4, scan=layers == "scan")
    batches = _batches(cfg, batch=16)
    want, want_params = _one_device(cfg, batches)
    got, model, s, opt = _staged(
        cfg, batches, stage=2, context=2, fsdp=2, data=1, context_mode=mode, microbatches=4
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params)
    found = s.explain(_step, args=(model, opt, batches[0]))
    kv = (16 // 4 // 2, 16, cfg.kv_heads, cfg.head_dim)  # a microbatch over fsdp; K or V
    if mode == "gather":
        signatures.assert_context_gather(found.collectives, kv=kv, layers=cfg.layers)
    else:
        signatures.assert_context_ring(found.collectives, kv=kv, layers=cfg.layers, context=2)
    scoped = [c for c in found.collectives if CONTEXT_SCOPE in c.op_name]
    assert scoped and all("pipeline_stages" in c.op_name for c in scoped)


SIX_AXES = textwrap.dedent(
    """
    import glob, json, os, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 64)
    import numpy as np
    from flax import nnx
    import strategies
    from dtensor.analysis.hlo import parse_collectives
    from examples.decoder import CONFIGS, Block, tensor_rules
    from tests.test_decoder import _batches
    from tests.test_compose import _build, _micro_aux_loss, _one_device, _staged
    from tests.test_pipeline import _close

    cfg = CONFIGS["tiny-moe"].replace(layers=4, scan=sys.argv[1] == "scan")
    batches = _batches(cfg, batch=16)
    want, want_params = _one_device(cfg, batches, _micro_aux_loss(2))
    dims = dict(data=2, fsdp=2, tensor=2, stage=2, context=2, expert=2, microbatches=2)
    got, model, s, _ = _staged(cfg, batches, rules=tensor_rules(cfg), **dims)
    print("losses", got, want)
    if cfg.scan:  # each stage holds its layers' experts, split over expert
        import dtensor
        spec = dtensor.fetch_layout(model.layers.moe.experts.gate.get_value()).sharding_specs
        assert spec[0] == "stage" and "expert" in spec, spec
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params)
    print("equal")
    # The step's program as XLA compiled it for run() (dumped by XLA_FLAGS: no second compile).
    (path,) = glob.glob(os.path.join(sys.argv[2], "*jit_pure*after_optimizations.txt"))
    found = parse_collectives(open(path).read(), list(s.mesh.shape.items()))
    print("bubble", s.bubble_fraction)
    print("collectives", json.dumps([c.to_dict() for c in found]))
    """
)


def _collectives(lines):
    """The subprocess's ``collectives`` line, as :class:`Collective` values."""
    from dtensor.analysis.hlo import Collective

    (line,) = [x for x in lines if x.startswith("collectives ")]
    out = []
    for d in json.loads(line.split(" ", 1)[1]):
        d.update(mesh_axes=tuple(d["mesh_axes"]), shape=tuple(d["shape"]))
        out.append(Collective(**d))
    return out


@pytest.mark.parametrize("layers", ["scan", "list"])
def test_all_six_axes_at_once_train_as_on_one_device(layers, tmp_path):
    """data x fsdp x tensor x stage x context x expert = 2 x 2 x 2 x 2 x 2 x 2 (64 simulated
    CPU devices, in a process of its own): the MoE decoder against single-device JAX, and
    each axis's signature (tests/signatures.py) in the program run() compiled, read from
    XLA's dump of it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    dump = tmp_path / "hlo"
    env["XLA_FLAGS"] = " ".join(
        filter(
            None,
            [env.get("XLA_FLAGS"), f"--xla_dump_to={dump}", "--xla_dump_hlo_module_re=jit_pure"],
        )
    )
    done = subprocess.run(
        [sys.executable, "-c", SIX_AXES, layers, str(dump)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert "equal" in lines
    found = _collectives(lines)
    (bubble,) = [float(x.split()[1]) for x in lines if x.startswith("bubble ")]
    # Per device, inside the stages: a microbatch of 16 / 2 rows over data x fsdp x expert
    # (1 row), its sequence of 16 split over context (8), heads split over tensor.
    micro = dict(rows=1, seq=8, d_model=64)
    # tensor: attention out's all-reduce and the experts' (each expert's hidden units split
    # over tensor, dtensor.expert_mlp summing the parts) in each layer
    signatures.assert_tensor(found, **micro, layers=4, per_layer=2)
    # stage: a microbatch's activations, its sequence split over context, passed on each tick
    signatures.assert_stage(found, **micro, ticks=2 + 2 - 1, bubble=bubble, stages=2)
    # context (gather, the default): the whole sequence's K/V over context, in the stages
    kv = (1, 16, 1, 16)  # 2 KV heads over tensor, 16 wide
    signatures.assert_context_gather(found, kv=kv, layers=4)
    scoped = [c for c in found if CONTEXT_SCOPE in c.op_name]
    assert scoped and all("pipeline_stages" in c.op_name for c in scoped)
    # expert: the tokens' all-to-alls, out and back
    signatures.assert_expert(found, layers=4)
    # fsdp: XLA's plan (stage needs gather_at_read off): the weights gathered over fsdp (with
    # context and expert, which HybridStrategy FSDP-splits over too), their gradients
    # all-reduced (XLA:CPU forms no reduce-scatter)
    signatures.assert_fsdp(found, None, reduce_scatter=False)
    # data: the gradients' all-reduces (over data alone, or with the axes that split the batch)
    grads = [c for c in found if c.kind == "all-reduce" and "data" in c.mesh_axes]
    assert [c for c in grads if signatures.backward(c)]
