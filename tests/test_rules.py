"""Tests for dtensor.core.rules: LayoutMap, logical axes, distribute over Flax/optax pytrees."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dtensor import (
    UNSHARDED,
    Layout,
    LayoutError,
    LayoutMap,
    create_mesh,
    distribute,
    fetch_layout,
    resolve_layouts,
)
from dtensor.core.tree import path_str


@pytest.fixture(scope="module")
def mesh():
    return create_mesh([("data", 4), ("model", 2)])


def _specs(x):
    return fetch_layout(x).sharding_specs


def _params():
    return {
        "embed": {"embedding": jnp.arange(32.0).reshape(16, 2)},
        "layers": [
            {"mlp": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros((4,))}},
            {"mlp": {"kernel": jnp.full((8, 4), 2.0), "bias": jnp.ones((4,))}},
        ],
        "head": {"kernel": jnp.ones((4, 8))},
    }


# ------------------------------------------------------------------ LayoutMap
def test_layout_map_first_match_wins(mesh):
    lm = LayoutMap(
        mesh,
        [
            ("layers/0/.*kernel", ("model", None)),
            ("kernel", (None, "model")),
            ("layers", ("data",)),
        ],
    )
    assert lm["layers/0/mlp/kernel"] == Layout(["model", None], mesh)
    assert lm["layers/1/mlp/kernel"] == Layout([None, "model"], mesh)
    assert lm["head/kernel"] == Layout([None, "model"], mesh)
    assert lm["layers/1/mlp/bias"] == Layout(["data"], mesh)
    assert lm["embed/embedding"] is None  # unmatched
    assert lm.match("layers/0/mlp/kernel") == ("layers/0/.*kernel", ("model", None))
    assert list(lm) == ["layers/0/.*kernel", "kernel", "layers"]
    assert len(lm) == 3


def test_layout_map_setitem_keeps_place_like_a_dict(mesh):
    lm = LayoutMap(mesh)
    lm["kernel"] = ("data", None)
    lm["mlp"] = (None, "model")
    lm["kernel"] = ("model", None)  # set again: still the first rule
    assert list(lm) == ["kernel", "mlp"]
    assert lm["mlp/kernel"] == Layout(["model", None], mesh)
    assert (
        "LayoutMap(Mesh(data=4, model=2), {'kernel': ('model', None), 'mlp': (None, 'model')})"
        == repr(lm)
    )


def test_layout_map_from_mapping_and_current_mesh(mesh):
    with mesh:
        lm = LayoutMap(rules={"w$": ("data", "model")})
    assert lm.mesh == mesh
    assert lm["dense/w"] == Layout(["data", "model"], mesh)
    assert lm["dense/w2"] is None


def test_logical_axis_rules(mesh):
    lm = LayoutMap(
        mesh,
        [
            ("kernel", ("embed", "mlp")),
            ("embedding", ("vocab", "embed")),
            ("act", ("batch", "heads")),
        ],
        logical_axis_rules=[
            ("embed", None),
            ("mlp", "model"),
            ("vocab", ("data", "model")),
            ("batch", "data"),
            ("heads", UNSHARDED),
        ],
    )
    assert lm["dense/kernel"] == Layout([None, "model"], mesh)
    assert lm["tok/embedding"] == Layout([("data", "model"), None], mesh)
    assert lm["act"] == Layout(["data", None], mesh)
    assert lm.resolve_axis(("batch", "mlp")) == ("data", "model")
    assert lm.resolve_axis("data") == "data"  # mesh names pass through
    assert lm.logical_axis_rules["mlp"] == "model"


def test_unmatched_leaves_are_replicated(mesh):
    lm = LayoutMap(mesh, [("kernel", (None, "model"))])
    out = distribute(_params(), lm)
    assert _specs(out["layers"][0]["mlp"]["kernel"]) == (UNSHARDED, "model")
    assert fetch_layout(out["layers"][0]["mlp"]["bias"]) == Layout.replicated(mesh, 1)
    assert fetch_layout(out["embed"]["embedding"]) == Layout.replicated(mesh, 2)
    np.testing.assert_array_equal(
        np.asarray(out["embed"]["embedding"]), np.arange(32.0).reshape(16, 2)
    )
    np.testing.assert_array_equal(
        np.asarray(out["layers"][1]["mlp"]["kernel"]), np.full((8, 4), 2.0)
    )


def test_path_str():
    tree = {"a": [1, {"b": 2}], "c": (3,)}
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    assert paths == ["a/0", "a/1/b", "c/0"]


# ---------------------------------------------------------------- distribute
def test_distribute_plain_dict_keeps_non_arrays(mesh):
    tree = {"w": np.ones((8, 2), np.float32), "name": "mlp", "step": 3, "nothing": None}
    out = distribute(tree, LayoutMap(mesh, [("w", ("data", None))]))
    assert out["name"] == "mlp" and out["step"] == 3 and out["nothing"] is None
    assert isinstance(out["w"], jax.Array)
    assert _specs(out["w"]) == ("data", UNSHARDED)


def test_distribute_abstract_tree_gives_laid_out_shapes(mesh):
    """``jax.eval_shape`` output (e.g. a 7B model's params) -> abstract values in their layouts."""
    params = jax.eval_shape(lambda: {"w": jnp.ones((8, 2)), "b": jnp.zeros((2,), jnp.bfloat16)})
    out = distribute(params, LayoutMap(mesh, [("w", ("data", None))]))
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in out.values())
    assert out["w"].sharding.spec == jax.sharding.PartitionSpec("data", None)
    assert out["b"].dtype == jnp.bfloat16 and out["b"].sharding.is_fully_replicated
    # Laid out like the concrete tree would be, and compilable ahead of time.
    concrete = distribute(
        {"w": np.ones((8, 2), np.float32)}, LayoutMap(mesh, [("w", ("data", None))])
    )
    assert out["w"].sharding == concrete["w"].sharding
    assert jax.jit(lambda t: t["w"] * 2).lower(out).compile() is not None


def test_distribute_by_function(mesh):
    seen = {}

    def policy(path, leaf):
        seen[path] = leaf.shape
        if leaf.ndim == 2 and leaf.shape[0] % 4 == 0:
            return Layout(["data", None], mesh)
        return None

    out = distribute(_params(), policy, mesh=mesh)
    assert seen["head/kernel"] == (4, 8)
    assert set(seen) == {
        "embed/embedding",
        "layers/0/mlp/kernel",
        "layers/0/mlp/bias",
        "layers/1/mlp/kernel",
        "layers/1/mlp/bias",
        "head/kernel",
    }
    assert _specs(out["embed"]["embedding"]) == ("data", UNSHARDED)
    assert _specs(out["layers"][1]["mlp"]["kernel"]) == ("data", UNSHARDED)
    assert fetch_layout(out["layers"][1]["mlp"]["bias"]).is_fully_replicated()
    with pytest.raises(
        LayoutError, match=r"returned None for 'layers/0/mlp/bias' and no mesh= was given"
    ):
        distribute(_params(), policy)


def test_distribute_by_tree_of_layouts(mesh):
    tree = {"a": jnp.arange(8.0), "b": jnp.ones((2, 4)), "c": jnp.zeros(3)}
    layouts = {"a": Layout(["data"], mesh), "b": Layout([None, "model"], mesh), "c": None}
    out = distribute(tree, layouts)
    assert fetch_layout(out["a"]) == layouts["a"]
    assert fetch_layout(out["b"]) == layouts["b"]
    assert out["c"] is tree["c"]  # None: left alone
    np.testing.assert_array_equal(np.asarray(out["a"]), np.arange(8.0))
    with pytest.raises(
        LayoutError, match=r"layout tree has 2 leaves but the tree to distribute has 3"
    ):
        distribute(tree, {"a": Layout(["data"], mesh), "b": Layout([None, "model"], mesh)})


def test_distribute_one_layout_for_all(mesh):
    out = distribute({"x": jnp.ones((8, 2)), "y": jnp.ones((4, 6))}, Layout(["data", None], mesh))
    assert _specs(out["x"]) == _specs(out["y"]) == ("data", UNSHARDED)


def test_distribute_without_layouts_replicates_on_current_mesh(mesh):
    with mesh:
        out = distribute({"x": jnp.ones((3, 5))})
    assert fetch_layout(out["x"]) == Layout.replicated(mesh, 2)
    with pytest.raises(ValueError, match=r"needs layouts= or a mesh"):
        distribute({"x": jnp.ones(3)})


def test_resolve_layouts_reports_rules(mesh):
    lm = LayoutMap(mesh, [("kernel", (None, "model"))])
    layouts, rules = resolve_layouts(_params(), lm)
    assert layouts["head"]["kernel"] == Layout([None, "model"], mesh)
    assert rules["head"]["kernel"] == "kernel"
    assert rules["head"] == {"kernel": "kernel"}
    assert rules["layers"][0]["mlp"]["bias"] is None


def test_optax_adam_state_follows_param_rules(mesh):
    params = {
        "dense": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros((4,))},
        "out": {"kernel": jnp.ones((4, 2))},
    }
    state = optax.adam(1e-3).init(params)
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    assert "0/mu/dense/kernel" in paths and "0/nu/dense/kernel" in paths
    lm = LayoutMap(mesh, [("dense/kernel$", ("data", "model")), ("out/kernel", ("model", None))])
    out = distribute({"params": params, "opt_state": state}, lm)
    adam = out["opt_state"][0]
    for moments in (adam.mu, adam.nu):
        assert _specs(moments["dense"]["kernel"]) == ("data", "model")
        assert _specs(moments["out"]["kernel"]) == ("model", UNSHARDED)
        assert fetch_layout(moments["dense"]["bias"]).is_fully_replicated()
    assert _specs(out["params"]["dense"]["kernel"]) == ("data", "model")
    assert fetch_layout(adam.count).rank == 0
    assert int(adam.count) == 0
    # The placed state still works with optax.
    grads = jax.tree.map(jnp.ones_like, out["params"])
    updates, _ = optax.adam(1e-3).update(grads, out["opt_state"], out["params"])
    np.testing.assert_allclose(np.asarray(updates["dense"]["kernel"]), -1e-3, rtol=1e-4)


# ---------------------------------------------------------------- Flax NNX
class _MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(
            8,
            16,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")),
        )
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.dense(x)))


def test_nnx_annotation_metadata_is_out_sharding(mesh):
    with mesh:
        model = _MLP(nnx.Rngs(0))
    assert model.dense.kernel.get_metadata()["out_sharding"] == (None, "model")
    assert _specs(model.dense.kernel[...]) == (UNSHARDED, "model")  # flax's eager sharding


def test_distribute_nnx_module_in_place(mesh):
    with mesh:
        model = _MLP(nnx.Rngs(0))
    before = {
        k: np.asarray(v)
        for k, v in [("dk", model.dense.kernel[...]), ("ok", model.out.kernel[...])]
    }
    lm = LayoutMap(mesh, [("kernel", ("model", None)), ("out/bias", ("model",))])
    assert distribute(model, lm) is model
    # The annotation wins over the matching rule; the rule places the rest.
    assert _specs(model.dense.kernel[...]) == (UNSHARDED, "model")
    assert _specs(model.out.kernel[...]) == ("model", UNSHARDED)
    assert _specs(model.out.bias[...]) == ("model",)
    assert fetch_layout(model.dense.bias[...]).is_fully_replicated()
    np.testing.assert_array_equal(np.asarray(model.dense.kernel[...]), before["dk"])
    np.testing.assert_array_equal(np.asarray(model.out.kernel[...]), before["ok"])
    y = model(jnp.ones((4, 8)))
    assert y.shape == (4, 4)


def test_distribute_nnx_ignores_annotations_when_asked(mesh):
    with mesh:
        model = _MLP(nnx.Rngs(0))
    distribute(model, LayoutMap(mesh, [("dense/kernel", ("data", None))], honor_annotations=False))
    assert _specs(model.dense.kernel[...]) == ("data", UNSHARDED)


def test_distribute_nnx_state(mesh):
    with mesh:
        model = _MLP(nnx.Rngs(0))
    state = nnx.state(model)
    out = distribute(state, LayoutMap(mesh, [("out/kernel", ("model", None))]))
    assert isinstance(out, nnx.State)
    assert _specs(out["out"]["kernel"][...]) == ("model", UNSHARDED)
    assert _specs(model.out.kernel[...]) == (UNSHARDED, UNSHARDED)  # a state copy: model untouched


def test_distribute_nnx_optimizer_state(mesh):
    with mesh:
        model = _MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    lm = LayoutMap(mesh, [("out/kernel", ("model", None))])
    assert distribute(optimizer, lm) is optimizer
    adam = optimizer.opt_state[0]
    for moments in (adam.mu, adam.nu):
        assert _specs(moments["out"]["kernel"][...]) == ("model", UNSHARDED)
        # The annotation carried over from the parameter.
        assert _specs(moments["dense"]["kernel"][...]) == (UNSHARDED, "model")
        assert fetch_layout(moments["out"]["bias"][...]).is_fully_replicated()
    # The optimizer does not hold the model: place it too.
    assert _specs(model.out.kernel[...]) == (UNSHARDED, UNSHARDED)
    distribute(model, lm)
    # One optimizer step runs with the placed state and keeps the layouts.
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((4, 8)))))(model)
    optimizer.update(model, grads)
    assert int(optimizer.step[...]) == 1
    assert _specs(model.out.kernel[...]) == ("model", UNSHARDED)
    assert _specs(optimizer.opt_state[0].mu["out"]["kernel"][...]) == ("model", UNSHARDED)


def test_distribute_nnx_module_with_rngs_and_batch_stats(mesh):
    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.note = "not an array"

        def __call__(self, x):
            return self.drop(self.bn(self.lin(x)))

    model = Net(nnx.Rngs(0, dropout=1))
    key_before = jax.random.key_data(model.drop.rngs.key[...])
    distribute(model, LayoutMap(mesh, [("lin/kernel", (None, "model")), ("bn/mean", ("model",))]))
    assert _specs(model.lin.kernel[...]) == (UNSHARDED, "model")
    assert _specs(model.bn.mean[...]) == ("model",)
    assert fetch_layout(model.bn.var[...]).is_fully_replicated()
    key = model.drop.rngs.key[...]
    assert fetch_layout(key).mesh == mesh
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(key)), np.asarray(key_before))
    assert model.note == "not an array"
    model.train()
    assert model(jnp.ones((8, 8))).shape == (8, 8)


def test_distribute_linen_logical_boxes(mesh):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(
                16,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.lecun_normal(), ("embed", "mlp")
                ),
            )(x)
            return nn.Dense(
                4, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None))
            )(x)

    params = Net().init(jax.random.key(0), jnp.ones((2, 8)))
    lm = LayoutMap(
        mesh, [("Dense_0/bias", ("mlp",))], logical_axis_rules=[("embed", None), ("mlp", "model")]
    )
    out = distribute(params, lm)
    k0 = out["params"]["Dense_0"]["kernel"]
    assert isinstance(k0, nn.LogicallyPartitioned)
    assert k0.names == ("embed", "mlp")
    assert _specs(k0.value) == (UNSHARDED, "model")
    k1 = out["params"]["Dense_1"]["kernel"]
    assert isinstance(k1, nn.Partitioned)
    assert _specs(k1.value) == ("model", UNSHARDED)
    assert _specs(out["params"]["Dense_0"]["bias"]) == ("model",)
    np.testing.assert_array_equal(
        np.asarray(k0.value), np.asarray(params["params"]["Dense_0"]["kernel"].value)
    )
    # The boxed params still apply.
    y = Net().apply(out, jnp.ones((2, 8)))
    assert y.shape == (2, 4)


# ------------------------------------------------------------------ bad input
def test_rule_matching_leaf_of_another_rank(mesh):
    lm = LayoutMap(mesh, [("mlp", (None, "model"))])
    with pytest.raises(
        LayoutError,
        match=r"rule 'mlp' matches 'layers/0/mlp/bias', which has rank 1 \(shape \(4,\)\).*rank 2",
    ):
        distribute(_params(), lm)


def test_rule_with_unknown_axis_names_path_and_axis(mesh):
    lm = LayoutMap(mesh, [("head/kernel", (None, "tensor"))])
    with pytest.raises(
        LayoutError, match=r"head/kernel \(rule 'head/kernel'\).*mesh axis 'tensor'"
    ):
        distribute(_params(), lm)


def test_rule_non_divisible_names_path(mesh):
    lm = LayoutMap(mesh, [("layers/0/mlp/bias", (("data", "model"),))])
    with pytest.raises(LayoutError, match=r"layers/0/mlp/bias dimension 0 has size 4.*8 shards"):
        distribute(_params(), lm)


def test_bad_layout_map_input(mesh):
    with pytest.raises(ValueError, match=r"not a valid regular expression"):
        LayoutMap(mesh, [("kernel[", (None,))])
    with pytest.raises(
        LayoutError, match=r"logical axis rule 'mlp' -> 'tensor' names mesh axis 'tensor'"
    ):
        LayoutMap(mesh, logical_axis_rules=[("mlp", "tensor")])
    with pytest.raises(TypeError, match=r"got specs 'model', a string.*\('model', None\)"):
        LayoutMap(mesh)["kernel"] = "model"
    with pytest.raises(ValueError, match=r"LayoutMap needs a mesh"):
        LayoutMap()
    with pytest.raises(TypeError, match=r"the layout for 'x' is a str, not a dtensor.Layout"):
        distribute({"x": jnp.ones(2)}, lambda path, leaf: "data")
