"""The names and messages of ClusterCoordinator across processes (the processes: tests/multiprocess)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

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
