"""The names and messages of ClusterCoordinator across processes (the processes: tests/multiprocess)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import dtensor.checkpoint
import strategies
from strategies.coordinator.plan import abstract_of, encode_value, resolve_value
from strategies.coordinator.remote import lookup, origin
from strategies.coordinator.values import RemoteIterator


@strategies.remote_function
def build():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    return model, nnx.Linear(1, 1, rngs=nnx.Rngs(1))


def test_a_builder_call_records_its_nodes() -> None:
    a, b = build()
    assert (origin(a).index, origin(b).index) == (0, 1)
    assert origin(a).builder == build.name and lookup(build.name) is build


def test_arguments_round_trip_through_json() -> None:
    a, _ = build()
    it = RemoteIterator(3, "ds", 2)
    encoded = encode_value((a, it, 0.5, {"k": [1, "x"]}), lambda v: origin(v).index)
    nodes = ("m0", "m1")
    got = resolve_value(encoded, nodes, lambda i, name: np.ones((2, 2)) * i)
    assert got[0] == "m0" and got[2] == 0.5 and got[3] == {"k": [1, "x"]}
    np.testing.assert_array_equal(got[1], np.full((2, 2), 3.0))
    abstract = abstract_of(got, nodes)
    assert abstract["seq"][1] == {"array": [[2, 2], "float64"]}


def test_errors() -> None:
    def inner(x):
        return x

    with pytest.raises(ValueError, match="defined inside another function cannot be found"):
        strategies.remote_function(inner)
    with pytest.raises(LookupError, match="no function named 'nope' is registered"):
        lookup("nope")
    with pytest.raises(TypeError, match="only NNX modules and optimizers made by"):
        encode_value(object(), lambda v: 0)
    with pytest.raises(TypeError, match="next\\(\\) on a per-worker iterator of a multi-process"):
        next(RemoteIterator(0, "ds", 2))


def test_names_the_other_tasks_cannot_find_are_refused() -> None:
    from strategies.coordinator.cluster import ClusterBackend, _named

    with pytest.raises(TypeError, match="a function the other tasks cannot find"):
        _named(lambda m: m, "schedule()")
    with pytest.raises(TypeError, match="that no registered builder made"):
        ClusterBackend._origin(nnx.Linear(1, 1, rngs=nnx.Rngs(0)), "schedule()")


def test_serve_and_the_coordinator_outside_their_roles() -> None:
    import dtensor.runtime

    with pytest.raises(RuntimeError, match="serve\\(\\) outside a parameter-server job"):
        dtensor.runtime.serve()
    with pytest.raises(RuntimeError, match="outside a parameter-server job"):
        dtensor.runtime.Server().join()


def test_single_process_save_and_restore(tmp_path) -> None:
    import optax

    strategy = strategies.ParameterServerStrategy(num_ps=2)
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    x = np.ones((4, 3), np.float32)

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - 1.0) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    with strategies.ClusterCoordinator(strategy, num_workers=2) as coordinator:
        for _ in range(3):
            coordinator.schedule(step, args=(model, optimizer, x))
        coordinator.join()
        coordinator.save(str(tmp_path), step=3)
        saved = jax.device_get(nnx.to_pure_dict(nnx.state((model, optimizer))))
        for _ in range(2):
            coordinator.schedule(step, args=(model, optimizer, x))
        coordinator.join()
        assert int(optimizer.step[...]) == 5
        coordinator.restore(str(tmp_path))
        fetched_model, fetched_optimizer = coordinator.fetch_variables()
    # what the coordinator hands back holds the checkpoint's values: the model's and the
    # optimizer's (its step count, Adam's moments), read from disk independently here
    on_disk = dtensor.checkpoint.restore(str(tmp_path), step=3)
    back = jax.device_get(nnx.to_pure_dict(nnx.state((fetched_model, fetched_optimizer))))
    assert jax.tree.structure(back) == jax.tree.structure(saved)
    for got, want, stored in zip(
        jax.tree.leaves(back), jax.tree.leaves(saved), jax.tree.leaves(on_disk), strict=True
    ):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, stored)
    assert int(fetched_optimizer.step[...]) == 3
    assert not np.array_equal(saved[1]["opt_state"][0]["mu"]["kernel"], 0)  # moments were saved


def test_parameter_shards_in_one_process_says_where_the_shards_are() -> None:
    strategy = strategies.ParameterServerStrategy(num_ps=2)
    with strategies.ClusterCoordinator(strategy, num_workers=2) as coordinator:
        with pytest.raises(
            RuntimeError,
            match=r"parameter_shards\(\) in one process.*"
            r"addressable_shards",
        ):
            coordinator.parameter_shards()
