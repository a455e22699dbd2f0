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
from examples.decoder import CONFIGS, Block
from tests import test_decoder
from tests.test_decoder import _batches, _step
from tests.test_pipeline import _close

REPO = Path(__file__).resolve().parent.parent


_build = functools.partial(test_decoder._build, eps=1e-3)


def _micro_aux_loss(microbatches):
    """The decoder's loss with its MoE loss taken per microbatch (rows ``m, m + M, ...``)
    and averaged, as a pipeline of ``M`` microbatches computes it; on one device."""

    def loss(model, batch):
        logits, _ = model(batch["x"], with_aux=True)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        x = batch["x"]
        aux = sum(model(x[m::microbatches], with_aux=True)[1] for m in range(microbatches))
        return ce + model.cfg.aux_loss_weight * aux / microbatches

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
    return [float(s.run(_step, args=(model, opt, b))) for b in batches], model


@pytest.mark.parametrize("layers", ["scan", "list"])
def test_moe_decoder_trains_in_stages_as_on_one_device(layers):
    """stage=2 x expert=2 x data=2: the experts split over ``expert`` inside each stage;
    the load-balancing loss of each microbatch added up over the layers, then averaged."""
    cfg = CONFIGS["tiny-moe"].replace(layers=4, scan=layers == "scan")
    batches = _batches(cfg, batch=16)
    want, want_params = _one_device(cfg, batches, _micro_aux_loss(4))
    got, model = _staged(cfg, batches, data=2, stage=2, expert=2, microbatches=4)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params)
    # Not the whole batch's load-balancing loss (a product of two means over the batch).
    whole, _ = _one_device(cfg, batches[:1])
    assert abs(got[0] - whole[0]) > 1e-5 * abs(whole[0])


@pytest.mark.parametrize(
    "layers, mode", [("scan", "gather"), ("list", "ring"), ("scan", "ring"), ("list", "gather")]
)
def test_decoder_with_context_trains_in_stages_as_on_one_device(layers, mode):
    """stage=2 x context=2 x fsdp=2: each tick's attention over the sequence shards."""
    cfg = CONFIGS["tiny"].replace(layers=4, scan=layers == "scan")
    batches = _batches(cfg, batch=16)
    want, want_params = _one_device(cfg, batches)
    got, model = _staged(
        cfg, batches, stage=2, context=2, fsdp=2, data=1, context_mode=mode, microbatches=4
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params)


SIX_AXES = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 64)
    import numpy as np
    from flax import nnx
    import strategies
    from examples.decoder import CONFIGS, Block
    from tests.test_decoder import _batches
    from tests.test_compose import _build, _micro_aux_loss, _one_device, _staged
    from tests.test_pipeline import _close

    cfg = CONFIGS["tiny-moe"].replace(layers=4, scan=sys.argv[1] == "scan")
    batches = _batches(cfg, batch=16)
    want, want_params = _one_device(cfg, batches, _micro_aux_loss(2))
    dims = dict(data=2, fsdp=2, tensor=2, stage=2, context=2, expert=2, microbatches=2)
    got, model = _staged(cfg, batches, **dims)
    print("losses", got, want)
    if cfg.scan:  # each stage holds its layers' experts, split over expert
        import dtensor
        spec = dtensor.fetch_layout(model.layers.moe.experts.gate.get_value()).sharding_specs
        assert spec[0] == "stage" and "expert" in spec, spec
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params)
    print("equal")
    """
)


@pytest.mark.parametrize("layers", ["scan", "list"])
def test_all_six_axes_at_once_train_as_on_one_device(layers):
    """data x fsdp x tensor x stage x context x expert = 2 x 2 x 2 x 2 x 2 x 2 (64 simulated
    CPU devices, in a process of its own): the MoE decoder against single-device JAX."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", SIX_AXES, layers],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "equal" in done.stdout.splitlines()
