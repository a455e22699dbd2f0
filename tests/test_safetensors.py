"""dtensor.checkpoint.load_safetensors / save_safetensors: the format, mappings, transforms,
layouts, byte counts and every error (each names the tensor, the file and the fix)."""

from __future__ import annotations

import itertools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dtensor
from dtensor import checkpoint
from dtensor.checkpoint import (
    CheckpointError,
    Mapping,
    Rule,
    astype,
    load_safetensors,
    merge_dims,
    permute,
    rope_permute,
    safetensors_save,
    save_safetensors,
    split_dim,
    transpose,
)


def _mesh(*dims):
    return dtensor.create_mesh(list(dims))


def _tree():
    rng = np.random.default_rng(0)
    return {
        "a": rng.standard_normal((16, 32)).astype(np.float32),
        "b": {"c": rng.standard_normal((8, 4, 6)).astype(np.float32)},
        "n": np.arange(5, dtype=np.int32),
    }


def _box_cases(shape):
    """A few boxes of ``shape``: whole, halves and quarters of each dimension, and a corner."""
    yield tuple((0, n) for n in shape)
    for d, n in enumerate(shape):
        for k in (2, 4):
            if n % k == 0:
                for j in range(k):
                    box = [(0, m) for m in shape]
                    box[d] = (j * n // k, (j + 1) * n // k)
                    yield tuple(box)
    yield tuple((n // 2, n) for n in shape)


@pytest.mark.parametrize(
    "transforms,shape",
    [
        ((transpose(),), (6, 8)),
        ((transpose(2, 0, 1),), (2, 3, 4)),
        ((transpose(), split_dim(1, (4, -1))), (32, 8)),
        ((split_dim(0, (2, 2, -1)), transpose(0, 2, 3, 1)), (16, 6)),
        ((merge_dims(0, (4, 2)),), (4, 2, 6)),
        ((rope_permute(0, 4), transpose()), (8, 3)),
        ((permute(1, [2, 0, 1]),), (4, 3)),
    ],
    ids=["T", "T3", "T-split", "split3-T", "merge", "rope-T", "permute"],
)
def test_every_box_of_a_transformed_tensor_reads_only_its_source_box(transforms, shape):
    """source_box + finish give the transformed tensor's box; undo inverts apply."""
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    shapes, y = [shape], x
    for t in transforms:
        shapes.append(t.shape(shapes[-1]))
        y = t.apply(y)
    assert y.shape == shapes[-1]
    back = y
    for t in transforms[::-1]:
        back = t.undo(back)
    np.testing.assert_array_equal(back, x)
    for box in _box_cases(y.shape):
        inner, fins = box, []
        for t, s in zip(transforms[::-1], shapes[-2::-1], strict=True):
            inner, fin = t.source_box(inner, s)
            fins.append(fin)
        piece = x[tuple(slice(a, b) for a, b in inner)]
        for fin in fins[::-1]:
            piece = fin(piece)
        np.testing.assert_array_equal(piece, y[tuple(slice(a, b) for a, b in box)])


def test_rope_permute_turns_meta_interleaved_pairs_into_hugging_face_halves():
    # HF's convert_llama_weights_to_hf: w.view(n, hd // 2, 2, d).transpose(1, 2).reshape(n*hd, d)
    w = np.arange(2 * 8 * 3).reshape(16, 3)
    hf = w.reshape(2, 4, 2, 3).transpose(0, 2, 1, 3).reshape(16, 3)
    np.testing.assert_array_equal(rope_permute(0, 8).apply(w), hf)
    np.testing.assert_array_equal(rope_permute(0, 8, to="interleaved").apply(hf), w)


def test_round_trip_across_layouts_files_and_the_safetensors_package(tmp_path):
    mesh = _mesh(("x", 8))
    tree = _tree()
    placed = {
        "a": dtensor.copy_to_mesh(tree["a"], dtensor.Layout([None, "x"], mesh)),
        "b": {"c": dtensor.copy_to_mesh(tree["b"]["c"], dtensor.Layout(["x", None, None], mesh))},
        "n": tree["n"],
    }
    index = save_safetensors(tmp_path, placed, max_shard_size="1KB")
    assert os.path.basename(index) == "model.safetensors.index.json"
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) == 2 and sorted(weight_map) == ["a", "b.c", "n"]
    # Hugging Face's own reader takes every file; each tensor is where the index says.
    for f in files:
        for name, value in load_file(tmp_path / f).items():
            assert weight_map[name] == f
            want = tree["b"]["c"] if name == "b.c" else tree[name]
            np.testing.assert_array_equal(value, want)
    # Into another mesh and layouts: shapes and dtypes from the checkpoint.
    other = _mesh(("p", 2), ("q", 4))
    stats: dict = {}
    out = load_safetensors(
        tmp_path,
        {
            "a": dtensor.Layout(["p", "q"], other),
            "b": {"c": dtensor.Layout([None, "p", None], other)},
            "n": np.zeros(5, np.int32),
        },
        stats=stats,
    )
    assert dtensor.fetch_layout(out["a"]) == dtensor.Layout(["p", "q"], other)
    np.testing.assert_array_equal(np.asarray(out["a"]), tree["a"])
    np.testing.assert_array_equal(np.asarray(out["b"]["c"]), tree["b"]["c"])
    assert isinstance(out["n"], np.ndarray) and out["n"].tolist() == [0, 1, 2, 3, 4]
    # Every byte read once: one process holds all 8 devices, each distinct slice read once.
    assert stats["bytes_read"] == sum(v.nbytes for v in jax.tree.leaves(tree))
    assert stats["files"] == 2


def test_replicas_on_one_process_read_their_slice_once(tmp_path):
    w = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    mesh = _mesh(("r", 2), ("c", 4))
    stats: dict = {}
    out = load_safetensors(tmp_path, {"w": dtensor.Layout([None, "c"], mesh)}, stats=stats)
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
    assert stats["bytes_read"] == w.nbytes  # 4 column slices, not 8 (2 replicas each)
    assert stats["tensors"] == 4 and stats["reads"] == 4 * 64  # a column slice: one run a row


def test_mapping_rules_stack_cast_and_save_back_under_the_checkpoint_names(tmp_path):
    rng = np.random.default_rng(1)
    hf = {
        f"model.layers.{i}.self_attn.{p}_proj.weight": rng.standard_normal((8, 6)).astype(
            ml_dtypes.bfloat16
        )
        for i in range(3)
        for p in "kv"
    }
    checkpoint.save_safetensors(tmp_path, hf)  # names without '/' are saved as they are
    mapping = Mapping(
        [
            Rule(
                "model.layers.{i}.self_attn.{kv}_proj.weight",
                "layers/kv",
                transpose(),
                split_dim(1, (2, -1)),
                astype(saved=jnp.bfloat16),
                stack={"kv": ("k", "v")},
            )
        ]
    )
    mesh = _mesh(("x", 2), ("y", 4))
    target = {
        "layers": {
            "kv": jax.ShapeDtypeStruct(
                (3, 2, 6, 2, 4),
                jnp.float32,
                sharding=dtensor.Layout([None, None, None, "x", "y"], mesh).sharding,
            )
        }
    }
    out = load_safetensors(tmp_path, target, mapping=mapping)
    kv = np.asarray(out["layers"]["kv"])
    assert kv.dtype == np.float32 and kv.shape == (3, 2, 6, 2, 4)
    for i, (j, p) in itertools.product(range(3), enumerate("kv")):
        want = np.asarray(hf[f"model.layers.{i}.self_attn.{p}_proj.weight"], np.float32)
        np.testing.assert_array_equal(kv[i, j], want.T.reshape(6, 2, 4))
    again = tmp_path / "again"
    save_safetensors(again, out, mapping=mapping)
    back = load_file(again / "model.safetensors")
    assert sorted(back) == sorted(hf)
    for name, value in hf.items():
        assert back[name].dtype == value.dtype and back[name].tobytes() == value.tobytes()


# ------------------------------------------------------------------- errors
@pytest.fixture
def sharded(tmp_path):
    """A two-file checkpoint with an index, as Hugging Face writes one."""
    tree = {"w": np.ones((64, 64), np.float32), "v": np.zeros(16, np.float32)}
    save_safetensors(tmp_path, tree, max_shard_size="10KB")
    return tmp_path, tree


def test_a_missing_tensor_names_it_the_rule_and_the_fix(sharded):
    path, _ = sharded
    target = {"w": np.zeros((64, 64), np.float32), "u": np.zeros(16, np.float32)}
    with pytest.raises(CheckpointError, match=r"tensor 'u' \(for 'u'.*is not in the checkpoint"):
        load_safetensors(path, target, mapping=Mapping({"w": "w", "u": "u"}, ignore=["v"]))
    with pytest.raises(CheckpointError, match=r"no mapping rule names a checkpoint tensor for 'u'"):
        load_safetensors(path, target, mapping=Mapping({"w": "w"}))


def test_an_extra_tensor_names_its_file_and_how_to_ignore_it(sharded):
    path, _ = sharded
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'v' in 'model-00001-of-00002.safetensors' is read by no leaf.*ignore=",
    ):
        load_safetensors(path, {"w": np.zeros((64, 64), np.float32)})
    out = load_safetensors(
        path, {"w": np.zeros((64, 64), np.float32)}, mapping=Mapping(default=True, ignore=["v"])
    )
    assert out["w"].sum() == 64 * 64


def test_shape_and_dtype_mismatches_name_tensor_file_and_fix(sharded):
    path, _ = sharded
    bad_shape = {"w": np.zeros((32, 64), np.float32), "v": np.zeros(16, np.float32)}
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'w' in 'model-00002-of-00002.safetensors' is float32\[64,64\].*'w' is "
        r"float32\[32,64\]: build the model with the checkpoint's config",
    ):
        load_safetensors(path, bad_shape)
    bad_dtype = {"w": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), "v": np.zeros(16, np.float32)}
    with pytest.raises(
        CheckpointError, match=r"tensor 'w' .* is float32, but 'w' is bfloat16: add astype"
    ):
        load_safetensors(path, bad_dtype)
    cast = Mapping([("w", "w", astype()), ("v", "v")])
    assert load_safetensors(path, bad_dtype, mapping=cast)["w"].dtype == jnp.bfloat16


def test_a_truncated_shard_names_the_file_and_the_tensors_it_cuts(sharded):
    path, _ = sharded
    f = path / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(
        CheckpointError,
        match=r"'model-00002-of-00002.safetensors' is truncated.*tensor\(s\) 'w' run past its "
        "end. Download or write the file again",
    ):
        load_safetensors(path, {"w": np.zeros((64, 64), np.float32), "v": np.zeros(16, np.float32)})


def test_an_index_naming_an_absent_file_says_which_tensor_and_file(sharded):
    path, _ = sharded
    (path / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"puts tensor 'v' in 'model-00001-of-00002.safetensors', which is not in .*Download",
    ):
        load_safetensors(path, {"w": np.zeros((64, 64), np.float32)})
    (path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"holds no .safetensors file"):
        load_safetensors(path / "empty", {})


def test_a_failed_save_leaves_no_index_and_no_partial_file(sharded, monkeypatch):
    path, tree = sharded
    calls = {"n": 0}
    real = safetensors_save._Writer.write

    def flaky(self, array):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        real(self, array)

    monkeypatch.setattr(safetensors_save._Writer, "write", flaky)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors(path, tree, max_shard_size="10KB")
    names = sorted(os.listdir(path))
    assert "model.safetensors.index.json" not in names  # the old index went first
    assert not [n for n in names if ".tmp-" in n]
    with pytest.raises(CheckpointError, match=r"holds 2 .safetensors files .* but no model"):
        load_safetensors(path, tree)  # nothing that loads as complete


def test_save_refuses_two_paths_on_one_name_and_unmapped_paths(tmp_path):
    tree = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    with pytest.raises(CheckpointError, match=r"'b' and 'a' both map to tensor 'x'.*save=False"):
        save_safetensors(tmp_path, tree, mapping=Mapping([("x", "a"), ("x", "b")]))
    with pytest.raises(
        CheckpointError, match=r"no mapping rule names a checkpoint tensor for \['b'\]"
    ):
        save_safetensors(tmp_path, tree, mapping=Mapping({"x": "a"}))
    with pytest.raises(ValueError, match=r"not a size"):
        save_safetensors(tmp_path, tree, max_shard_size="lots")


def test_a_checkpoint_in_a_bucket_loads_by_ranged_reads(gcs):
    mesh = _mesh(("x", 8))
    w = np.arange(256 * 8, dtype=np.float32).reshape(256, 8)
    save_safetensors(gcs, {"w": dtensor.copy_to_mesh(w, dtensor.Layout(["x", None], mesh))})
    stats: dict = {}
    out = load_safetensors(gcs, {"w": dtensor.Layout(["x", None], mesh)}, stats=stats)
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
    assert stats["bytes_read"] == w.nbytes and stats["reads"] <= 8
    with pytest.raises(CheckpointError, match=r"does not exist"):
        load_safetensors(gcs + "/absent", {"w": dtensor.Layout(["x", None], mesh)})


def test_a_users_own_nnx_model_needs_only_a_dict_mapping(tmp_path):
    """The guide's example: a PyTorch-style state dict into an NNX model built under a preset."""
    from flax import nnx

    import strategies

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 64, rngs=rngs)
            self.down = nnx.Linear(64, 16, rngs=rngs)

    rng = np.random.default_rng(0)
    torch_names = {
        "fc1.weight": rng.standard_normal((64, 16)).astype(np.float32),  # [out, in]
        "fc1.bias": rng.standard_normal(64).astype(np.float32),
        "fc2.weight": rng.standard_normal((16, 64)).astype(np.float32),
        "fc2.bias": rng.standard_normal(16).astype(np.float32),
    }
    save_file(torch_names, str(tmp_path / "model.safetensors"))
    mapping = {
        "fc1.weight": ("up/kernel", transpose()),
        "fc1.bias": "up/bias",
        "fc2.weight": ("down/kernel", transpose()),
        "fc2.bias": "down/bias",
    }
    strategy = strategies.FullyShardedStrategy(min_shard_bytes=0)
    with strategy.scope():
        model = MLP(nnx.Rngs(0))
    load_safetensors(tmp_path / "model.safetensors", model, mapping=mapping)
    kernel = model.up.kernel.get_value()
    assert dtensor.fetch_layout(kernel).sharding_specs[1] == "fsdp"
    np.testing.assert_array_equal(np.asarray(kernel), torch_names["fc1.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.down.bias.get_value()), torch_names["fc2.bias"])
    save_safetensors(tmp_path / "back", model, mapping=mapping)
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert all(back[n].tobytes() == v.tobytes() for n, v in torch_names.items())
