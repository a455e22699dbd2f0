"""dtensor.checkpoint.load_safetensors / save_safetensors: the format, mappings, transforms,
layouts, byte counts and every error (each names the tensor, the file and the fix)."""

from __future__ import annotations

import itertools
import json
import os
import struct

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
    # astype() widens losslessly only: float32 into bfloat16 loses bits, so it is asked for.
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'w' in 'model-00002-of-00002.safetensors' is stored as float32, but 'w' "
        r"is bfloat16: float32 -> bfloat16 is not a lossless float widening.*astype\('bfloat16'\)",
    ):
        load_safetensors(path, bad_dtype, mapping=Mapping([("w", "w", astype()), ("v", "v")]))
    cast = Mapping([("w", "w", astype(jnp.bfloat16)), ("v", "v")])
    assert load_safetensors(path, bad_dtype, mapping=cast)["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "stored,target,ok",
    [
        (ml_dtypes.bfloat16, np.float32, True),
        (np.float16, np.float32, True),
        (np.float32, np.float32, True),
        (np.float32, np.float64, True),
        (np.int32, np.float32, False),
        (np.uint8, np.float32, False),
        (np.bool_, np.float32, False),
        (np.float32, ml_dtypes.bfloat16, False),
        (np.float16, ml_dtypes.bfloat16, False),
        (np.float64, np.float32, False),
    ],
)
def test_only_lossless_float_widening_loads_without_an_explicit_dtype(tmp_path, stored, target, ok):
    values = np.asarray([1, 0, 1, 1], stored)
    save_file({"norm.weight": values}, str(tmp_path / "model.safetensors"))
    want = {"norm": np.zeros(4, target)}  # read on the host (float64 too)
    implicit = Mapping([("norm.weight", "norm", astype())])
    if ok:
        out = load_safetensors(tmp_path, want, mapping=implicit)["norm"]
        assert out.dtype == np.dtype(target) and np.asarray(out).tolist() == [1, 0, 1, 1]
    else:
        s, t = np.dtype(stored).name, np.dtype(target).name
        with pytest.raises(
            CheckpointError,
            match=rf"tensor 'norm.weight' in 'model.safetensors' is stored as {s}, but 'norm' is "
            rf"{t}: {s} -> {t} is not a lossless float widening.*not cast silently.*explicit "
            rf"dtype in the rule: astype\('{t}'\)",
        ):
            load_safetensors(tmp_path, want, mapping=implicit)
    # An explicit dtype is the user asking: any stored dtype is cast to it.
    explicit = Mapping([("norm.weight", "norm", astype(target))])
    out = load_safetensors(tmp_path, want, mapping=explicit)["norm"]
    assert out.dtype == np.dtype(target) and np.asarray(out).tolist() == [1, 0, 1, 1]


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


def _old_and_new(tmp_path):
    """A checkpoint of three shards (plus a config.json beside it) and a new tree to save over it."""
    rng = np.random.default_rng(5)
    old = {k: rng.standard_normal((32, 32)).astype(np.float32) for k in ("a", "b", "c")}
    new = {k: v + 1 for k, v in old.items()}
    path = tmp_path / "ckpt"
    save_safetensors(path, old, max_shard_size="5KB")
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path, old, new


def _listing(path):
    return sorted(os.listdir(path))


def _loads_as(path, tree):
    out = load_safetensors(path, {k: np.zeros_like(v) for k, v in tree.items()})
    for k, v in tree.items():
        np.testing.assert_array_equal(out[k], v, err_msg=k)


def test_a_save_that_fails_midway_leaves_the_last_checkpoint_loadable(tmp_path, monkeypatch):
    path, old, new = _old_and_new(tmp_path)
    before = {n: (path / n).read_bytes() for n in _listing(path)}
    real, calls = safetensors_save._Writer.write, {"n": 0}

    def disk_full_after_the_first_shard(self, array):
        calls["n"] += 1
        if calls["n"] == 2:  # the second tensor: the first shard is whole, the second begun
            raise OSError(27, "File too large")
        real(self, array)

    monkeypatch.setattr(safetensors_save._Writer, "write", disk_full_after_the_first_shard)
    with pytest.raises(
        CheckpointError,
        match=rf"save_safetensors\('{path}'\): writing 'model-00002-of-00003.safetensors' \(in "
        rf"'{path}.safetensors-tmp'\) failed: OSError: \[Errno 27\] File too large. The "
        rf"checkpoint at '{path}' is unchanged.*Free space, or raise the file-size limit",
    ) as info:
        save_safetensors(path, new, max_shard_size="5KB")
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == 27
    assert {n: (path / n).read_bytes() for n in _listing(path)} == before  # byte for byte
    assert _listing(tmp_path) == ["ckpt"]  # the files written beside it are gone too
    _loads_as(path, old)


def test_a_save_killed_by_the_file_size_limit_keeps_the_last_checkpoint(tmp_path):
    """A real EFBIG: a process whose files may not pass 64 KiB (RLIMIT_FSIZE) saves a tree
    with a 200 KB tensor over a checkpoint of small ones."""
    import subprocess
    import sys

    path, old, _ = _old_and_new(tmp_path)
    script = f"""
import resource, signal, numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead of a kill
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
from dtensor.checkpoint import save_safetensors
tree = {{"a": np.ones((32, 32), np.float32), "big": np.ones((50_000,), np.float32)}}
save_safetensors({str(path)!r}, tree, max_shard_size="5KB")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "[Errno 27] File too large" in proc.stderr, proc.stderr[-2000:]
    assert "writing 'model-00002-of-00002.safetensors'" in proc.stderr, proc.stderr[-2000:]
    assert f"The checkpoint at '{path}' is unchanged" in proc.stderr
    assert _listing(tmp_path) == ["ckpt"]
    _loads_as(path, old)


def test_a_successful_save_leaves_no_stale_shards_and_keeps_other_files(tmp_path):
    path, old, new = _old_and_new(tmp_path)
    assert len([n for n in _listing(path) if n.endswith(".safetensors")]) == 3
    save_safetensors(path, {"a": new["a"]})  # one file now: no index, no old shards
    assert _listing(path) == ["config.json", "model.safetensors"]
    assert (path / "config.json").read_text() == '{"model_type": "llama"}'  # carried over
    _loads_as(path, {"a": new["a"]})
    save_safetensors(path, new, max_shard_size="9KB")  # and back to shards: the old file goes
    assert _listing(path) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    _loads_as(path, new)
    assert _listing(tmp_path) == ["ckpt"]


def test_a_save_stopped_between_its_renames_is_recovered(tmp_path):
    """A save killed after moving the old folder aside: a load names where the checkpoint is,
    and the next save puts it back before replacing it."""
    path, old, new = _old_and_new(tmp_path)
    aside = tmp_path / "ckpt.safetensors-old"
    os.rename(path, aside)
    (tmp_path / "ckpt.safetensors-tmp").mkdir()  # the killed save's unfinished files
    (tmp_path / "ckpt.safetensors-tmp" / "model-00001-of-00003.safetensors").write_bytes(b"x")
    with pytest.raises(
        CheckpointError, match=rf"'{path}' does not exist: a save there was stopped.*'{aside}'"
    ):
        _loads_as(path, old)
    save_safetensors(path, new, max_shard_size="5KB")
    assert _listing(tmp_path) == ["ckpt"]
    assert "config.json" in _listing(path)  # the old folder came back first, then was replaced
    _loads_as(path, new)


def test_a_folder_that_cannot_be_renamed_is_swapped_file_by_file(tmp_path, monkeypatch):
    """A mount point (or a folder in a parent the job may not write): the save writes inside
    it, and the same holds: a failure keeps the old checkpoint, success leaves no stale
    shard, and a crash during the renames is undone by the next save."""
    from dtensor.checkpoint import safetensors_commit

    path, old, new = _old_and_new(tmp_path)
    monkeypatch.setattr(safetensors_commit, "_renamable", lambda folder: False)
    before = {n: (path / n).read_bytes() for n in _listing(path)}
    real, calls = safetensors_save._Writer.write, {"n": 0}

    def fail_second(self, array):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real(self, array)

    with monkeypatch.context() as m:
        m.setattr(safetensors_save._Writer, "write", fail_second)
        with pytest.raises(
            CheckpointError,
            match=rf"writing 'model-00002-of-00003.safetensors' \(in '{path}/.safetensors-tmp'\)"
            r".*No space left on device.*is unchanged",
        ):
            save_safetensors(path, new, max_shard_size="5KB")
    assert {n: (path / n).read_bytes() for n in _listing(path)} == before
    _loads_as(path, old)
    save_safetensors(path, new, max_shard_size="9KB")
    assert _listing(path) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    _loads_as(path, new)
    # Killed while swapping: the old index moved aside, a new shard moved in, no new index.
    (path / ".safetensors-old").mkdir()
    os.rename(
        path / "model.safetensors.index.json",
        path / ".safetensors-old/model.safetensors.index.json",
    )
    os.rename(
        path / "model-00001-of-00002.safetensors",
        path / ".safetensors-old/model-00001-of-00002.safetensors",
    )
    (path / "model-00001-of-00002.safetensors").write_bytes(b"half of a new save")
    with pytest.raises(CheckpointError, match=r"holds 2 .safetensors files .* but no model"):
        _loads_as(path, new)
    calls["n"] = 0
    with monkeypatch.context() as m:  # the next save puts the old files back first...
        m.setattr(safetensors_save._Writer, "write", fail_second)
        with pytest.raises(CheckpointError, match=r"No space left on device"):
            save_safetensors(path, old, max_shard_size="5KB")
    _loads_as(path, new)  # ...so even a failed one leaves the last checkpoint loadable
    save_safetensors(path, {"a": old["a"]})
    assert _listing(path) == ["config.json", "model.safetensors"]
    _loads_as(path, {"a": old["a"]})


def test_a_file_at_the_path_is_refused_not_replaced(tmp_path):
    f = tmp_path / "weights"
    f.write_text("not a folder")
    with pytest.raises(
        CheckpointError,
        match=rf"save_safetensors: '{f}' is a file, but a safetensors checkpoint is a folder.*"
        r"Pass a folder's path.*or remove the file first",
    ):
        save_safetensors(f, {"a": np.zeros(2, np.float32)})
    assert f.read_text() == "not a folder" and _listing(tmp_path) == ["weights"]


def _edit_header(path, edit):
    """Rewrite a safetensors file's JSON header through ``edit(header)``; the data stays."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    edit(head)
    text = json.dumps(head).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _offsets(**ranges):
    def edit(head):
        for name, r in ranges.items():
            head[name]["data_offsets"] = list(r)

    return edit


@pytest.mark.parametrize(
    "ranges,extra,match",
    [
        # 'b' re-pointed into 'a''s bytes (its length kept): the two overlap
        ({"b": (8, 24)}, b"", r"tensor 'a' \(bytes 0-16\) and tensor 'b' \(bytes 8-24\) overlap"),
        # 'b' moved 8 bytes on, into data appended to the file: a gap
        (
            {"b": (24, 40)},
            b"\0" * 8,
            r"tensor 'a' \(bytes 0-16\) and tensor 'b' \(bytes 24-40\) "
            r"leave 8 bytes between them",
        ),
        # bytes after the last tensor
        ({}, b"\0" * 16, r"has 48 bytes of data after its header, but its tensors cover 32"),
    ],
    ids=["overlap", "gap", "trailing"],
)
def test_tensors_whose_byte_ranges_do_not_tile_the_data_are_refused(tmp_path, ranges, extra, match):
    f = tmp_path / "model.safetensors"
    save_file({"a": np.arange(4, dtype=np.float32), "b": np.ones(4, np.float32)}, str(f))
    _edit_header(f, _offsets(**ranges))
    f.write_bytes(f.read_bytes() + extra)
    with pytest.raises(Exception, match=r"invalid offset|incomplete"):  # so does safetensors
        load_file(f)
    target = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    with pytest.raises(
        CheckpointError,
        match=rf"safetensors file 'model.safetensors' .*{match}.*"
        r"(download or write it again)",
    ):
        load_safetensors(f, target)
    with pytest.raises(CheckpointError, match=match):
        load_safetensors(tmp_path, target)  # through the folder, too


def _torch_zip(path):
    """A file laid out as torch.save writes one since PyTorch 1.6: a zip of data.pkl + storages."""
    import pickle
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": "storage 0"}, protocol=2))
        z.writestr("archive/data/0", np.ones(16, np.float32).tobytes())
        z.writestr("archive/version", "3\n")


def test_a_pytorch_checkpoint_is_named_as_one_with_how_to_convert_it(tmp_path):
    import pickle

    target = {"w": np.zeros(16, np.float32)}
    bin_ = tmp_path / "pytorch_model.bin"
    _torch_zip(bin_)
    fix = r"Convert it to safetensors where torch is installed: `from safetensors.torch import"
    with pytest.raises(
        CheckpointError,
        match=rf"'pytorch_model.bin' is a zip archive: a PyTorch pickle checkpoint \(torch.save, "
        rf"as pytorch_model.bin\), not safetensors.*{fix}",
    ):
        load_safetensors(bin_, target)
    with pytest.raises(CheckpointError, match=rf"is the weights in '{tmp_path}': a PyTorch pickle"):
        load_safetensors(tmp_path, target)  # the folder, holding it and no .safetensors
    legacy = tmp_path / "old" / "pytorch_model.bin"  # torch.save before 1.6: a bare pickle
    legacy.parent.mkdir()
    legacy.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"is a Python pickle: a PyTorch pickle checkpoint"):
        load_safetensors(legacy, target)
    index = tmp_path / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "pytorch_model.bin"}}))
    with pytest.raises(CheckpointError, match=r"is an index naming 'pytorch_model.bin': a PyTorch"):
        load_safetensors(index, target)


def test_a_damaged_index_names_the_file(sharded):
    path, tree = sharded
    index = path / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-7])  # cut short, as a partial download
    with pytest.raises(
        CheckpointError,
        match=rf"index '{index}' is not valid JSON \(.*\): a partial download or a damaged "
        r"file. Download it again",
    ):
        load_safetensors(path, tree)
    index.write_text(json.dumps({"weight_map": ["w", "v"]}))
    with pytest.raises(CheckpointError, match=r"has no 'weight_map' of tensor name -> file name"):
        load_safetensors(path, tree)


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


def test_a_save_over_a_checkpoint_in_a_bucket_keeps_it_until_the_new_one_is_whole(gcs, monkeypatch):
    from dtensor.checkpoint import storage

    def listing(url):
        storage.refresh(url)
        return sorted(p.name for p in storage.resolve(url).iterdir())

    rng = np.random.default_rng(2)
    old = {k: rng.standard_normal((32, 32)).astype(np.float32) for k in ("a", "b", "c")}
    new = {k: v + 1 for k, v in old.items()}
    save_safetensors(gcs, old, max_shard_size="5KB")
    (storage.resolve(gcs) / "config.json").write_text("{}")
    real, calls = safetensors_save._Writer.write, {"n": 0}

    def fail_second(self, array):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real(self, array)

    with monkeypatch.context() as m:
        m.setattr(safetensors_save._Writer, "write", fail_second)
        with pytest.raises(CheckpointError, match=r"writing 'model-00002-of-00003.safetensors'"):
            save_safetensors(gcs, new, max_shard_size="5KB")
    assert listing(gcs) == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    parent = gcs.rstrip("/").rsplit("/", 1)[0]
    assert not [n for n in listing(parent) if "safetensors-tmp" in n]
    _loads_as(gcs, old)
    save_safetensors(gcs, {"a": new["a"]})  # one file: the old shards and index go
    assert listing(gcs) == ["config.json", "model.safetensors"]
    assert not [n for n in listing(parent) if "safetensors-tmp" in n]
    _loads_as(gcs, {"a": new["a"]})


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


def test_the_pretrained_guides_measured_figures_are_the_benchmarks_results_rounded():
    """docs/guides/pretrained.md's table and prose against benchmarks/results/safetensors_load.json:
    every figure to two decimals (GiB of 2^30 bytes), one per process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "benchmarks", "results", "safetensors_load.json")) as f:
        runs = json.load(f)["runs"]
    with open(os.path.join(root, "docs", "guides", "pretrained.md")) as f:
        guide = f.read()
    rows = {
        "`load_safetensors` | 1 x 8 devices": "dtensor, 1 process, rows",
        "`load_safetensors` | 2 x 4 devices": "dtensor, 2 processes, rows",
        "`load_safetensors`, columns split | 2 x 4 devices": "dtensor, 2 processes, columns",
        "`load_file` + `jax.device_put` | 1": "load_file + device_put, 1 process",
        "`load_file` + own shards | 2": "load_file + device_put, 2 processes",
    }
    gib = 2**30

    def cell(values, *, equal=None):
        """Each process's figure (``a / b``), or one (``equal``: its suffix) where all agree."""
        text = [f"{v:.2f}" for v in values]
        if len(text) == 1 or (equal is not None and len(set(text)) == 1):
            return text[0] + ((equal or "") if len(text) > 1 else "")
        return " / ".join(text)

    for label, key in rows.items():
        ps = sorted(runs[key], key=lambda r: r["process"])
        cells = [
            cell([r["seconds"] for r in ps]),
            cell([r["bytes_read"] / gib for r in ps], equal=" each"),
            cell([r["held_bytes"] / gib for r in ps], equal=""),
            cell([(r["rss_peak"] - r["rss_before"]) / gib for r in ps]),
        ]
        row = f"| {label} | " + " | ".join(cells) + " |"
        assert row in guide, row
    extra = [
        (r["rss_peak"] - r["rss_before"] - r["held_bytes"]) / gib
        for k, v in runs.items()
        if k.startswith("dtensor")
        for r in v
    ]
    assert f"plus\n{min(extra):.2f} to {max(extra):.2f} GiB" in guide
