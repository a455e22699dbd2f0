"""dtensor.explain and the HLO collective parser, checked against hand-computed bytes."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dtensor
from dtensor.analysis.explain import min_comm_bytes
from dtensor.analysis.hlo import (
    array_bytes,
    dtype_bits,
    parse_collectives,
    parse_replica_groups,
    ring_bytes,
)
from dtensor.analysis.hlo_text import computations, multipliers

F32 = 4
# MLP parameters: w1 16x32, b1 32, w2 32x4 -> 672 floats.
PARAM_BYTES = (16 * 32 + 32 + 32 * 4) * F32  # 2688


@pytest.fixture(scope="module")
def mesh8():
    return dtensor.create_mesh([("x", 8)])


@pytest.fixture(scope="module")
def mesh42():
    return dtensor.create_mesh([("a", 4), ("b", 2)])


def sds(shape, layout, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=layout.sharding)


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def sgd_step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def mlp(mesh, param_specs):
    params = {
        "w1": sds((16, 32), dtensor.Layout(param_specs["w1"], mesh)),
        "b1": sds((32,), dtensor.Layout(param_specs["b1"], mesh)),
        "w2": sds((32, 4), dtensor.Layout(param_specs["w2"], mesh)),
    }
    batch = {
        "x": sds((64, 16), dtensor.Layout(["x", None], mesh)),
        "y": sds((64, 4), dtensor.Layout(["x", None], mesh)),
    }
    return params, batch


# ------------------------------------------------------------------ explain
def test_data_parallel_step_one_combined_all_reduce(mesh8):
    params, batch = mlp(mesh8, {"w1": [None, None], "b1": [None], "w2": [None, None]})
    r = dtensor.explain(sgd_step, params, batch)
    assert {c.name for c in r.collectives} == {r.collectives[0].name}  # one HLO instruction
    assert {(c.kind, c.mesh_axes, c.group_size) for c in r.collectives} == {
        ("all-reduce", ("x",), 8)
    }
    # Gradients plus the scalar loss, each 2*7/8 of its bytes.
    assert r.comm_bytes_per_device == pytest.approx(2 * 7 / 8 * (PARAM_BYTES + F32))
    assert r.min_comm_bytes_per_device == pytest.approx(2 * 7 / 8 * PARAM_BYTES)
    assert r.data_axes == ("x",)
    assert r.state_bytes_per_device == PARAM_BYTES
    assert r.ideal_state_bytes_per_device == PARAM_BYTES // 8
    batch_bytes = (64 * 16 + 64 * 4) * F32 // 8
    assert r.argument_bytes_per_device == PARAM_BYTES + batch_bytes
    assert r.output_bytes_per_device >= PARAM_BYTES + F32
    assert r.warnings == ()
    assert [(v.path, v.layout, v.bytes_per_device) for v in r.variables] == [
        ("b1", "[unsharded]", 32 * F32),
        ("w1", "[unsharded, unsharded]", 16 * 32 * F32),
        ("w2", "[unsharded, unsharded]", 32 * 4 * F32),
    ]


def expected_bytes(c):
    n, size = c.group_size, math.prod(c.shape) * F32
    return {
        "all-reduce": 2 * (n - 1) / n * size,
        "all-gather": (n - 1) / n * size,
        "reduce-scatter": (n - 1) / n * (n * size),
        "all-to-all": (n - 1) / n * size,
        "collective-permute": size,
    }[c.kind]


def test_fully_sharded_step_matches_formulas(mesh8):
    params, batch = mlp(mesh8, {"w1": ["x", None], "b1": ["x"], "w2": ["x", None]})
    r = dtensor.explain(sgd_step, params, batch, expect_sharded=True, replicated_warn_bytes=0)
    assert r.collectives
    for c in r.collectives:
        assert (c.mesh_axes, c.group_size, c.dtype) == (("x",), 8, "f32")
        assert c.bytes_per_device == pytest.approx(expected_bytes(c))
    gathered = {c.shape for c in r.collectives if c.kind == "all-gather"}
    assert gathered and gathered <= {(16, 32), (32,), (32, 4)}  # whole parameters
    assert r.comm_bytes_per_device == pytest.approx(sum(c.bytes_per_device for c in r.collectives))
    # The ZeRO reference: two all-gathers and one reduce-scatter per parameter; the
    # per-matmul one (moving each device's share of the small batch) is lower, and is the
    # minimum.
    refs = r.min_comm_references
    assert refs["weights gathered (ZeRO)"] == pytest.approx(3 * 7 / 8 * PARAM_BYTES)
    per_matmul = refs["per matmul: cheaper of weight or activations"]
    assert 0 < per_matmul < refs["weights gathered (ZeRO)"]
    assert r.min_comm_bytes_per_device == pytest.approx(per_matmul) and r.comm_ratio >= 1
    assert r.state_bytes_per_device == r.ideal_state_bytes_per_device == PARAM_BYTES // 8
    assert [v.layout for v in r.variables] == ["[x]", "[x, unsharded]", "[x, unsharded]"]
    assert r.warnings == ()


def test_explicit_relayout_is_an_all_to_all(mesh8):
    src, dst = dtensor.Layout(["x", None], mesh8), dtensor.Layout([None, "x"], mesh8)
    f = jax.jit(lambda a: a * 2, in_shardings=src.sharding, out_shardings=dst.sharding)
    r = dtensor.explain(f, jax.ShapeDtypeStruct((16, 16), jnp.float32), variables={})
    assert {(c.kind, c.mesh_axes, c.group_size) for c in r.collectives} == {
        ("all-to-all", ("x",), 8)
    }
    local = 16 * 16 * F32 // 8
    assert r.comm_bytes_per_device == pytest.approx(7 / 8 * local)
    assert r.variables == () and r.min_comm_bytes_per_device == 0
    # As the step's state (the default: args[0]) the change of layout is reported.
    r2 = dtensor.explain(f, jax.ShapeDtypeStruct((16, 16), jnp.float32))
    assert [(w.kind, w.path) for w in r2.warnings] == [("silent-replication", "output")]
    assert r2.variables[0].layout == "[x, unsharded]"  # taken from the compiled in_shardings


def test_dtensor_collectives_map_to_both_mesh_axes(mesh42):
    ab = dtensor.Layout(["a", "b"], mesh42)
    x = sds((8, 8), ab)
    r = dtensor.explain(lambda v: dtensor.all_gather(v, "b", layout=ab), x, variables={})
    [c] = r.collectives
    assert (c.kind, c.mesh_axes, c.group_size, c.shape) == ("all-gather", ("b",), 2, (2, 8))
    assert c.bytes_per_device == 1 / 2 * 2 * 8 * F32

    a_only = dtensor.Layout(["a", None], mesh42)
    r = dtensor.explain(
        lambda v: dtensor.all_gather(v, "a", layout=a_only), sds((8, 8), a_only), variables={}
    )
    [c] = r.collectives
    assert (c.kind, c.mesh_axes, c.group_size, c.shape) == ("all-gather", ("a",), 4, (8, 8))
    assert c.bytes_per_device == 3 / 4 * 64 * F32

    rep = dtensor.Layout.replicated(mesh42, 2)
    r = dtensor.explain(
        lambda v: dtensor.reduce_scatter(v, "a", layout=rep), sds((8, 8), rep), variables={}
    )
    [c] = r.collectives
    assert (c.kind, c.mesh_axes, c.group_size, c.shape) == ("reduce-scatter", ("a",), 4, (2, 8))
    assert c.bytes_per_device == 3 / 4 * 64 * F32  # (n-1)/n of the input

    r = dtensor.explain(
        lambda v: dtensor.reduce_scatter(v, "b", dim=1, layout=rep), sds((8, 8), rep), variables={}
    )
    [c] = r.collectives
    assert (c.kind, c.mesh_axes, c.group_size, c.shape) == ("reduce-scatter", ("b",), 2, (8, 4))

    r = dtensor.explain(lambda v: dtensor.all_reduce(v, ("b", "a"), layout=ab), x, variables={})
    [c] = r.collectives
    assert (c.kind, c.mesh_axes, c.group_size) == ("all-reduce", ("b", "a"), 8)
    assert c.bytes_per_device == 2 * 7 / 8 * 2 * 4 * F32


@pytest.mark.parametrize(("reduce_dim", "out_spec", "axis"), [(1, P("a"), "b"), (0, P("b"), "a")])
def test_partitioner_collectives_map_to_mesh_axes(mesh42, reduce_dim, out_spec, axis):
    # GSPMD/Shardy collectives print replica groups in the `mesh[...] {...}` syntax.
    ab = dtensor.Layout(["a", "b"], mesh42)
    out = jax.sharding.NamedSharding(mesh42.jax_mesh, out_spec)
    f = jax.jit(lambda v: v.sum(reduce_dim), out_shardings=out)
    r = dtensor.explain(f, sds((8, 8), ab), variables={})
    [c] = r.collectives
    assert (c.kind, c.mesh_axes, c.group_size) == ("all-reduce", (axis,), mesh42.shape[axis])


def test_permuted_device_order_maps_through_the_mesh():
    devices = jax.devices()
    mesh = dtensor.create_mesh(
        [("a", 4), ("b", 2)], devices=[devices[i] for i in (3, 1, 2, 0, 7, 5, 6, 4)]
    )
    ab = dtensor.Layout(["a", "b"], mesh)
    r = dtensor.explain(
        lambda v: dtensor.all_reduce(v, "a", layout=ab), sds((8, 8), ab), variables={}
    )
    assert [(c.mesh_axes, c.group_size) for c in r.collectives] == [(("a",), 4)]


def test_loop_collectives_count_trip_count(mesh42):
    def body(c, w):
        return c @ w, None

    def f(x, ws):
        return jax.lax.scan(body, x, ws)[0].sum()

    ws = sds((3, 8, 8), dtensor.Layout([None, "a", None], mesh42))
    x = sds((8, 8), dtensor.Layout(["a", None], mesh42))
    r = dtensor.explain(jax.grad(f, argnums=1), x, ws, variables={})
    looped = [c for c in r.collectives if c.count == 3]
    assert looped and all(c.mesh_axes == ("a",) for c in looped)
    assert r.comm_bytes_per_device == pytest.approx(
        sum(c.bytes_per_device * c.count for c in r.collectives)
    )


def test_jitted_fn_with_concrete_arrays_is_compiled_not_run(mesh8):
    calls = []
    rep = dtensor.Layout.replicated(mesh8, 1)

    def f(v):
        jax.debug.callback(lambda: calls.append(1))
        return v + 1

    v = dtensor.copy_to_mesh(jnp.zeros(8), rep)
    r = dtensor.explain(jax.jit(f, in_shardings=rep.sharding, out_shardings=rep.sharding), v)
    assert calls == []
    assert r.variables[0].layout == "[unsharded]" and r.collectives == ()


def test_uncommitted_arrays_take_the_compiled_layout(mesh8):
    params = {"w": jnp.zeros((512, 1024))}  # uncommitted: jit replicates it
    x = dtensor.copy_to_mesh(jnp.ones((8, 512)), dtensor.Layout(["x", None], mesh8))
    r = dtensor.explain(lambda p, x: (x @ p["w"]).sum(), params, x, expect_sharded=True)
    assert [(v.path, v.layout, v.bytes_per_device) for v in r.variables] == [
        ("w", "[unsharded, unsharded]", 512 * 1024 * F32)
    ]
    assert [(w.kind, w.path) for w in r.warnings] == [("replicated", "w")]


def test_optimizer_state_does_not_count_towards_the_minimum(mesh8):
    params, batch = mlp(mesh8, {"w1": [None, None], "b1": [None], "w2": [None, None]})
    tx = optax.adam(1e-3)
    opt_state = jax.eval_shape(tx.init, params)
    rep = lambda leaf: sds(leaf.shape, dtensor.Layout.replicated(mesh8, leaf.ndim), leaf.dtype)  # noqa: E731
    state = {"params": params, "opt_state": jax.tree.map(rep, opt_state)}

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}, loss

    r = dtensor.explain(step, state, batch, activation_bytes_min=100.0)
    assert r.min_comm_bytes_per_device == pytest.approx(2 * 7 / 8 * PARAM_BYTES + 100.0)
    trainable = {v.path for v in r.variables if v.trainable}
    assert trainable == {"params/b1", "params/w1", "params/w2"}
    assert r.state_bytes_per_device == 3 * PARAM_BYTES + 4  # params, mu, nu, int32 count
    r2 = dtensor.explain(step, state, batch, grad_paths=lambda p: p == "params/w1")
    assert r2.min_comm_bytes_per_device == pytest.approx(2 * 7 / 8 * 16 * 32 * F32)


def test_min_comm_formulas_on_two_axes(mesh42):
    s = 800
    fsdp_b = dtensor.Layout(["b", None], mesh42)
    # Sharded over data axis b (k=2), replicated over data axis a (r=4): hybrid.
    assert min_comm_bytes(s, fsdp_b, ["a", "b"]) == pytest.approx(3 * 1 / 2 * s + 2 * 3 / 4 * s / 2)
    # b is a tensor axis: each device's part is s/2, all-reduced over a.
    assert min_comm_bytes(s, fsdp_b, ["a"]) == pytest.approx(2 * 3 / 4 * s / 2)
    assert min_comm_bytes(s, dtensor.Layout.replicated(mesh42, 2), []) == 0.0


# ----------------------------------------------------------------- warnings
def shard_largest_divisible(mesh, shape):
    """A planted FSDP-like policy: the largest dimension divisible by 8, else replicated."""
    dims = sorted((d for d in range(len(shape)) if shape[d] % 8 == 0), key=lambda d: -shape[d])
    specs = [None] * len(shape)
    if dims:
        specs[dims[0]] = "x"
    return dtensor.Layout(specs, mesh)


def test_non_divisible_dimension_warns_replicated(mesh8):
    shapes = {"odd": (10, 30), "even": (16, 32)}
    state = {k: sds(s, shard_largest_divisible(mesh8, s)) for k, s in shapes.items()}
    r = dtensor.explain(
        lambda s: jax.tree.map(lambda a: a * 2, s),
        state,
        expect_sharded=True,
        replicated_warn_bytes=1000,
    )
    assert [(w.kind, w.path) for w in r.warnings] == [("replicated", "odd")]
    assert (
        "odd [10, 30] float32" in r.warnings[0].message
        and "replicated on all 8 devices" in r.warnings[0].message
    )
    # Pure data parallel on a one-axis mesh: replication is the plan, no warning.
    double = lambda s: jax.tree.map(lambda a: a * 2, s)  # noqa: E731
    assert dtensor.explain(double, state, data_axes="x", replicated_warn_bytes=1000).warnings == ()
    # With no data axes at all, every axis is off-data: the replicated leaf is reported.
    assert [
        w.path for w in dtensor.explain(double, state, replicated_warn_bytes=1000).warnings
    ] == ["odd"]


def test_replicated_warns_when_mesh_has_off_data_axes(mesh42):
    state = {"w": sds((64, 64), dtensor.Layout.replicated(mesh42, 2))}
    r = dtensor.explain(lambda s: s, state, data_axes="a")
    assert [w.kind for w in r.warnings] == []  # 16 KiB is under the default 1 MiB
    r = dtensor.explain(lambda s: s, state, data_axes="a", replicated_warn_bytes=1024)
    assert [(w.kind, w.path) for w in r.warnings] == [("replicated", "w")]


def test_unmatched_leaf_warns(mesh8):
    params = {"dense": {"kernel": jnp.zeros((16, 8)), "bias": jnp.zeros((8,))}}
    lm = dtensor.LayoutMap(mesh8, [("kernel", ("x", None))])
    layouts, rules = dtensor.resolve_layouts(params, lm)
    state = jax.tree.map(lambda a, lay: sds(a.shape, lay), params, layouts)
    r = dtensor.explain(lambda s: s, state, rules=rules)
    assert [(w.kind, w.path) for w in r.warnings] == [("unmatched", "dense/bias")]
    assert [(v.path, v.rule) for v in r.variables] == [
        ("dense/bias", None),
        ("dense/kernel", "kernel"),
    ]
    r = dtensor.explain(lambda s: s, state, rules={"dense/bias": "bias", "dense/kernel": "kernel"})
    assert r.warnings == ()


def test_silent_replication_of_outputs_warns(mesh8):
    sharded = dtensor.Layout(["x", None], mesh8)
    state = {"w": sds((16, 4), sharded), "v": sds((8, 8), sharded)}
    rep = dtensor.Layout.replicated(mesh8, 2).sharding
    scalar = dtensor.Layout.replicated(mesh8, 0).sharding
    out_shardings = ({"w": rep, "v": sharded.sharding}, scalar)
    step = jax.jit(
        lambda s, b: ({k: a * b.sum() for k, a in s.items()}, b.sum()), out_shardings=out_shardings
    )
    r = dtensor.explain(step, state, sds((8,), dtensor.Layout(["x"], mesh8)))
    assert [(w.kind, w.path) for w in r.warnings] == [("silent-replication", "output[0]/w")]
    assert (
        "[x, unsharded]" in r.warnings[0].message
        and "[unsharded, unsharded]" in r.warnings[0].message
    )


# ------------------------------------------------------------ report output
def test_to_dict_is_stable_json_and_str_has_tables(mesh8):
    params, batch = mlp(mesh8, {"w1": ["x", None], "b1": [None], "w2": [None, None]})
    r = dtensor.explain(sgd_step, params, batch, rules={"w1": "w1", "b1": None, "w2": "w2"})
    d = r.to_dict()
    once, twice = json.dumps(d), json.dumps(r.to_dict())
    assert once == twice == json.dumps(d, sort_keys=True)  # keys sorted at every level
    again = dtensor.explain(sgd_step, params, batch, rules={"w1": "w1", "b1": None, "w2": "w2"})
    assert again.to_json() == r.to_json()
    assert json.loads(once)["comm_bytes_per_device"] == r.comm_bytes_per_device
    text = str(r)
    for needle in (
        "Collectives",
        "Variables",
        "all-reduce",
        "w1",
        "[x, unsharded]",
        "Warnings",
        "[unmatched] b1",
    ):
        assert needle in text


# --------------------------------------------------------------------- errors
def test_errors(mesh8):
    x = sds((8,), dtensor.Layout(["x"], mesh8))
    with pytest.raises(TypeError, match="first argument must be the function"):
        dtensor.explain(x)
    with pytest.raises(TypeError, match="got no arguments and no variables="):
        dtensor.explain(lambda: 1.0)
    with pytest.raises(TypeError, match="variable 'w' .* has no sharding"):
        dtensor.explain(lambda a: a, x, variables={"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    with pytest.raises(ValueError, match=r"rules= has 1 leaves but variables has 2"):
        dtensor.explain(lambda a: a, {"u": x, "v": x}, rules=["one"])
    with pytest.raises(ValueError, match=r"data_axes='batch' names \['batch'\], not axes"):
        dtensor.explain(lambda a: a, x, data_axes="batch")


# ------------------------------------------------------------- HLO parsing
def test_replica_group_syntaxes():
    assert parse_replica_groups("{{0,1},{2,3}}", 4) == [[0, 1], [2, 3]]
    assert parse_replica_groups("{}", 4) == [[0, 1, 2, 3]]
    assert parse_replica_groups(None, 2) == [[0, 1]]
    assert parse_replica_groups("[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("[4,2]<=[2,4]T(1,0)", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert parse_replica_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", 8) == [
        [0, 2, 4, 6],
        [1, 3, 5, 7],
    ]
    assert parse_replica_groups("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_2'}", 8) == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert parse_replica_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_1','axis_0'}", 8) == [
        [0, 4, 1, 5, 2, 6, 3, 7]
    ]
    # Sub-axes: the middle 2 of an axis of 8, and its outer and inner 2.
    assert parse_replica_groups("mesh['axis_0'=8] {'axis_0':(2)2}", 8) == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
    ]
    assert parse_replica_groups("mesh['axis_0'=8] {'axis_0':(1)2,'axis_0':(4)2}", 8) == [
        [0, 1, 4, 5],
        [2, 3, 6, 7],
    ]
    assert parse_replica_groups("mesh['a'=4,'b'=2], device_ids=([4,2]<=[2,4]T(1,0)) {'a'}", 8) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    assert parse_replica_groups("maximal_mesh[device_id=3]", 8) == [[3]]


HLO = """HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4,2])) -> (s32[], f32[4,2]) {
  %p = (s32[], f32[4,2]{1,0}) parameter(0)
  %g = f32[4,2]{1,0} get-tuple-element(%p), index=1
  %cp = f32[4,2]{1,0} collective-permute(%g), channel_id=5, source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,2]{1,0}) tuple(%i, %cp)
}

%cond (p: (s32[], f32[4,2])) -> pred[] {
  %p = (s32[], f32[4,2]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8], b: bf16[4,6]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = bf16[4,6]{1,0} parameter(1)
  %ar = (f32[8]{0}, bf16[4,6]{1,0}, /*index=2*/f32[]) all-reduce(%a, %b, %a), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add
  %ags = (f32[2]{0}, f32[16]{0}) all-gather-start(%a), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[16]{0} all-gather-done(%ags)
  %rs = f32[1]{0} reduce-scatter(%a), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %aa = f32[8]{0} all-to-all(%a), channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={0}
  %init = (s32[], f32[4,2]{1,0}) tuple(%c0, %g0)
  %w = (s32[], f32[4,2]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[8]{0} add(%a, %a)
}
"""


def test_parse_collectives_on_handwritten_hlo():
    cs = parse_collectives(HLO, [("a", 4), ("b", 2)])
    got = [
        (c.kind, c.mesh_axes, c.dtype, c.shape, c.group_size, c.bytes_per_device, c.count)
        for c in cs
    ]
    assert sorted(got) == sorted(
        [
            # tuple all-reduce, one entry per operand; iota groups {0,2,4,6},{1,3,5,7} = axis a
            ("all-reduce", ("a",), "f32", (8,), 4, 2 * 3 / 4 * 32, 1),
            ("all-reduce", ("a",), "bf16", (4, 6), 4, 2 * 3 / 4 * 48, 1),
            ("all-reduce", ("a",), "f32", (), 4, 2 * 3 / 4 * 4, 1),
            # async pair counted once, with the done's shape
            ("all-gather", ("a", "b"), "f32", (16,), 8, 7 / 8 * 64, 1),
            ("reduce-scatter", ("a", "b"), "f32", (1,), 8, 7 * 4, 1),
            ("all-to-all", ("b",), "f32", (8,), 2, 1 / 2 * 32, 1),
            # in a while body with a known trip count of 5
            ("collective-permute", ("a",), "f32", (4, 2), 4, 32.0, 5),
        ]
    )
    assert [c.name for c in cs if c.kind == "all-gather"] == ["ags"]
    # Without a mesh, axes are unknown but sizes and bytes are not.
    assert {c.mesh_axes for c in parse_collectives(HLO, None, num_devices=8)} == {()}


LOOP_HLO = """HloModule loops

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %cp = f32[4]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], f32[4]{0}) tuple(%p, %cp)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] COMPARE
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %c0 = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%c0, %a)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""


@pytest.mark.parametrize(
    "compare",
    [
        "compare(%i, %n), direction=LT",  # jaxlib's CPU/TPU text
        "compare(s32[] %i, s32[] %n), direction=LT",  # operands printed with their types
        "compare(%p#0, %n), direction=LT",  # newer libtpu: a tuple element of the parameter
        "compare(%n, %i), direction=GT",
    ],
)
def test_while_trip_count_read_from_the_loop_condition(compare):
    """Optimised TPU HLO drops known_trip_count; the count comes from ``counter < N``."""
    comps, entry = computations(LOOP_HLO.replace("COMPARE", compare))
    assert multipliers(comps, entry)["body"] == 7
    (c,) = parse_collectives(LOOP_HLO.replace("COMPARE", compare), None, num_devices=2)
    assert c.count == 7


SPLIT_CALL = """  %kernel = f32[4]{0} custom-call(%a), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "x",
"xprof_metadata":"{\\"block_q\\": 512}"
}}, metadata={op_name="splash"}
"""


def test_an_instruction_spanning_lines_keeps_its_computation():
    """libtpu 0.0.50+ prints a custom call's backend_config with newlines (MaxText's splash
    attention): the lines after it still belong to the computation, so the while loop and
    the collectives in its body keep their trip count."""
    text = LOOP_HLO.replace("COMPARE", "compare(%i, %n), direction=LT")
    text = text.replace("  %c0 = s32[] constant(0)\n", SPLIT_CALL + "  %c0 = s32[] constant(0)\n")
    text = text.replace("  %cp = ", SPLIT_CALL.replace("%a", "%x") + "  %cp = ")
    assert text.count("\n}}, metadata") == 2
    comps, entry = computations(text)
    assert [i.opcode for i in comps["main"]][-3:] == ["tuple", "while", "get-tuple-element"]
    assert "custom-call" in [i.opcode for i in comps["body"]]
    assert multipliers(comps, entry)["body"] == 7
    (c,) = parse_collectives(text, None, num_devices=2)
    assert (c.kind, c.count) == ("collective-permute", 7)


def test_byte_helpers():
    assert dtype_bits("bf16") == 16 and dtype_bits("f8e4m3fn") == 8 and dtype_bits("pred") == 8
    assert array_bytes("s4", (3,)) == 2 and array_bytes("f32", ()) == 4
    assert (
        ring_bytes("all-reduce", 100, 1) == 0.0
        and ring_bytes("collective-permute", 100, 1) == 100.0
    )
    with pytest.raises(ValueError, match="unknown HLO element type 'q7'"):
        dtype_bits("q7")
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
        ring_bytes("broadcast", 100, 8)
    assert np.isclose(ring_bytes("all-gather", 800, 8), 700.0)


# libtpu's async collective fusion, as in a Gemma 2B layer on v5e:4x4 (libtpu 0.0.42): the
# all-gather of a kernel starts in the layer's body, continues inside a collective-matmul loop
# (trip count 8) and ends after it; every piece repeats the whole all-gather with one
# channel_id and threads the gathered buffer through the loop.
CHAIN_HLO = """HloModule jit_pure

%start_fusion (p0: bf16[128,256]) -> bf16[2048,256] {
  %p0 = bf16[128,256]{1,0} parameter(0)
  %ag.1 = bf16[2048,256]{1,0} all-gather(%p0), channel_id=64, replica_groups=[1,16]<=[16], dimensions={0}, use_global_device_ids=true, frontend_attributes={chain_id="2"}
  ROOT %s = bf16[2048,256]{1,0} custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.7 (p0: bf16[128,256], p1: bf16[2048,256]) -> bf16[2048,256] {
  %p0 = bf16[128,256]{1,0} parameter(0)
  %p1 = bf16[2048,256]{1,0} parameter(1)
  ROOT %ag.2 = bf16[2048,256]{1,0} all-gather(%p0), channel_id=64, replica_groups=[1,16]<=[16], dimensions={0}, use_global_device_ids=true, frontend_attributes={chain_id="2"}
}

%done_fusion (p0: bf16[128,256], p1: bf16[2048,256]) -> bf16[2048,256] {
  %p0 = bf16[128,256]{1,0} parameter(0)
  %p1 = bf16[2048,256]{1,0} parameter(1)
  %ag.3 = bf16[2048,256]{1,0} all-gather(%p0), channel_id=64, replica_groups=[1,16]<=[16], dimensions={0}, use_global_device_ids=true, frontend_attributes={chain_id="2"}
  ROOT %d = bf16[2048,256]{1,0} custom-call(%ag.3, %p1), custom_call_target="AsyncCollectiveDone"
}

%windowed_dot_general_body (p: (s32[], bf16[128,256], bf16[2048,256])) -> (s32[], bf16[128,256], bf16[2048,256]) {
  %p = (s32[], bf16[128,256]{1,0}, bf16[2048,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[128,256]{1,0} get-tuple-element(%p), index=1
  %buf = bf16[2048,256]{1,0} get-tuple-element(%p), index=2
  %f = bf16[2048,256]{1,0} fusion(%x, %buf), kind=kCustom, calls=%async_collective_fusion.7
  %cp = bf16[128,256]{1,0} collective-permute(%x), channel_id=65, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], bf16[128,256]{1,0}, bf16[2048,256]{1,0}) tuple(%i, %cp, %f)
}

%cond (p: (s32[], bf16[128,256], bf16[2048,256])) -> pred[] {
  %p = (s32[], bf16[128,256]{1,0}, bf16[2048,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[128,256]) -> bf16[2048,256] {
  %a = bf16[128,256]{1,0} parameter(0)
  %s = bf16[2048,256]{1,0} fusion(%a), kind=kCustom, calls=%start_fusion
  %c0 = s32[] constant(0)
  %init = (s32[], bf16[128,256]{1,0}, bf16[2048,256]{1,0}) tuple(%c0, %a, %s)
  %w = (s32[], bf16[128,256]{1,0}, bf16[2048,256]{1,0}) while(%init), condition=%cond, body=%windowed_dot_general_body
  %y = bf16[128,256]{1,0} get-tuple-element(%w), index=1
  %b = bf16[2048,256]{1,0} get-tuple-element(%w), index=2
  ROOT %r = bf16[2048,256]{1,0} fusion(%y, %b), kind=kCustom, calls=%done_fusion
}
"""


def test_an_async_collective_fusion_chain_counts_once():
    """The continuations (8 loop trips) and the end repeat the started all-gather: read as
    one all-gather where it starts, not ten (what the floor counted before: libtpu chains
    held half the ICI bytes of a Gemma 2B step on v5e:4x4)."""
    gathers = [c for c in parse_collectives(CHAIN_HLO, None, 16) if c.kind == "all-gather"]
    assert [(c.name, c.count, c.shape) for c in gathers] == [("ag.1", 1, (2048, 256))]
    assert gathers[0].bytes_per_device == 15 / 16 * 2048 * 256 * 2
    permutes = [c for c in parse_collectives(CHAIN_HLO, None, 16) if c.kind != "all-gather"]
    assert [(c.kind, c.count) for c in permutes] == [("collective-permute", 8)]
    every = parse_collectives(CHAIN_HLO, None, 16, chained_copies=True)
    assert sorted((c.name, c.count) for c in every if c.kind == "all-gather") == [
        ("ag.1", 1),
        ("ag.2", 8),
        ("ag.3", 1),
    ]
    # A continuation whose start is not in the text (no matching channel) still counts.
    orphan = CHAIN_HLO.replace(
        "channel_id=64, replica_groups=[1,16]<=[16], dimensions={0}, "
        'use_global_device_ids=true, frontend_attributes={chain_id="2"}\n'
        "  ROOT %s",
        "channel_id=63, replica_groups=[1,16]<=[16], "
        "dimensions={0}, use_global_device_ids=true\n  ROOT %s",
    )
    names = sorted(c.name for c in parse_collectives(orphan, None, 16) if c.kind == "all-gather")
    assert names == ["ag.1", "ag.2", "ag.3"]
