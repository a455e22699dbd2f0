"""strategies.step.cache: bounded caches weak on functions and models, and the recompile warning.

The last test is the one the caches exist for: 300 ``run`` calls, each with a
fresh lambda, compile 300 times but keep memory bounded, and warn once.
"""

from __future__ import annotations

import gc
import re
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import strategies
from strategies.step.cache import FunctionKey, GraphCaches, LRUCache, RecompileMonitor


# ----------------------------------------------------------------- LRUCache
def test_lru_cache_keeps_its_most_recently_used_entries():
    cache = LRUCache(3)
    for k in range(10):
        cache.put(k, str(k))
    assert len(cache) == 3
    assert [cache.get(k) for k in range(10)] == [None] * 7 + ["7", "8", "9"]
    assert cache.get(7) == "7"  # now the most recent: 8 goes first
    cache.put(10, "10")
    assert (cache.get(8), cache.get(7), cache.get(9), cache.get(10)) == (None, "7", "9", "10")
    cache.discard_where(lambda k: k % 2 == 1)
    assert (len(cache), cache.get(10)) == (1, "10")  # 7 and 9 were odd


# ---------------------------------------------------------------- FunctionKey
class Trainer:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def step(self, x: float) -> float:
        return self.scale * x


def test_function_key_of_a_bound_method_is_its_function_and_instance():
    trainer, other = Trainer(2.0), Trainer(3.0)
    # Python makes a new bound method at every access: the key must still be one.
    first, second = trainer.step, trainer.step
    a, b = FunctionKey(first), FunctionKey(second)
    assert a == b and hash(a) == hash(b)
    assert FunctionKey(other.step) != a
    assert FunctionKey(Trainer.step) != a  # the plain function is another step
    assert a.get()(5.0) == 10.0


def test_function_key_does_not_keep_its_function_alive():
    died: list[object] = []
    trainer = Trainer(2.0)
    key = FunctionKey(trainer.step, died.append)
    del trainer
    gc.collect()
    assert len(died) == 1 and key.holds(died[0])  # how a cache finds the dead key's entries
    with pytest.raises(ReferenceError, match="garbage collected"):
        key.get()

    fn = lambda x: x  # noqa: E731
    key = FunctionKey(fn, died.append)
    del fn
    gc.collect()
    assert len(died) == 2


def test_function_key_holds_callables_that_refuse_weak_references():
    key = FunctionKey(len)  # a builtin: no weak references, held strongly
    assert key == FunctionKey(len) and key.get()([1, 2]) == 2


# ---------------------------------------------------------------- GraphCaches
def test_graph_caches_drop_a_graph_when_its_model_dies():
    caches = GraphCaches(maxsize=4)
    model, other = nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    first = caches.get([model])
    assert caches.get([model]) is first  # walked once
    caches.get([model, other])
    assert len(caches) == 2
    del model
    gc.collect()
    assert len(caches) == 0  # both graphs held the dead model
    caches.get([other])
    assert len(caches) == 1


def test_graph_caches_are_bounded():
    caches = GraphCaches(maxsize=2)
    models = [nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(5)]
    for m in models:
        caches.get([m])
    assert len(caches) == 2


# ----------------------------------------------------------- RecompileMonitor
def test_recompile_monitor_warns_once_per_code_naming_the_fix():
    monitor = RecompileMonitor(threshold=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            monitor.compiled(lambda x: x)
        monitor.compiled(len)  # no code object: not counted
    assert len(caught) == 1
    assert caught[0].category is RuntimeWarning
    assert re.search(r"3 times.*Define the step once \(a named function\)", str(caught[0].message))


# ------------------------------------------------------- explain() and run()
def test_run_and_explain_of_the_same_arguments_compile_the_step_once():
    """``explain`` and ``run`` of a step with arguments of the same shapes share one program:
    explain after run reports run's, run after explain runs explain's (nothing traced or
    compiled again either way), the reports equal; a batch of another shape is compiled for
    itself."""
    compiles: list[str] = []

    def listen(event: str, duration: float, **kw: object) -> None:
        if event.endswith("/backend_compile_duration"):
            compiles.append(event)

    def build(strategy):
        with strategy.scope():
            model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
            return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    x = np.ones((8, 8), np.float32)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first_run = strategies.FullyShardedStrategy(min_shard_bytes=0)
        model, optimizer = build(first_run)
        first_run.run(step, args=(model, optimizer, x))
        del compiles[:]
        after_run = first_run.explain(step, args=(model, optimizer, x))
        assert compiles == []

        first_explain = strategies.FullyShardedStrategy(min_shard_bytes=0)
        model, optimizer = build(first_explain)
        before_run = first_explain.explain(step, args=(model, optimizer, x))
        assert len(compiles) == 1
        first_explain.run(step, args=(model, optimizer, x))
        first_explain.run(step, args=(model, optimizer, x), cache_graph=True)
        assert len(compiles) == 1

        assert after_run == before_run and after_run.collectives  # every figure but `compiled`
        other = first_explain.explain(step, args=(model, optimizer, np.ones((16, 8), np.float32)))
        assert len(compiles) == 2
        assert other.argument_bytes_per_device > after_run.argument_bytes_per_device
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


# ------------------------------------------------------------- bounded memory
def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_300_runs_with_fresh_lambdas_keep_memory_bounded_and_warn_once():
    strategy = strategies.MirroredStrategy(devices=jax.devices()[:2])
    with strategy.scope():
        model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x = np.ones((4, 8), np.float32)

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    def fresh_runs(n: int) -> None:
        for _ in range(n):
            strategy.run(lambda m, o, x: step(m, o, x), args=(model, optimizer, x))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh_runs(50)  # warm up: XLA, JAX's own caches, allocator pools
        gc.collect()
        before = _rss_mb()
        fresh_runs(300)
        gc.collect()
        grown = _rss_mb() - before
    print(f"RSS growth over 300 fresh-lambda runs: {grown:.1f} MB")
    assert grown < 100, f"RSS grew {grown:.0f} MB over 300 runs with fresh lambdas"
    recompiles = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(recompiles) == 1, [str(w.message) for w in recompiles]
    assert "a named function" in str(recompiles[0].message)
    assert "<lambda>" in str(recompiles[0].message)
