"""Hugging Face checkpoints into examples/decoder.py and Flax's Gemma, checked against the
logits ``transformers`` itself computed (tests/data/make_hf.py stored them; no torch here).

The checkpoints are written here as ``transformers`` writes them (its tensor names, Linear
weights ``[out, in]``, files cut by size with ``model.safetensors.index.json``) with the
``safetensors`` package, from the weights of tests/data/hf_weights.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import dtensor
import strategies
from dtensor.checkpoint import load_safetensors, save_safetensors
from examples.decoder import Decoder, from_hf_config, hf_mapping, tensor_rules
from tests.data import hf_weights

DATA = Path(__file__).resolve().parent / "data"
ARCH = {"llama": hf_weights.LLAMA, "gemma": hf_weights.GEMMA, "gemma3": hf_weights.GEMMA3}


def write_hf(folder: Path, arch: str, *, files: int = 3) -> dict[str, np.ndarray]:
    """The tiny model's checkpoint as transformers lays it out: ``files`` shards + index."""
    tensors = hf_weights.weights(ARCH[arch])
    names = list(tensors)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, part in enumerate(np.array_split(np.arange(len(names)), files)):
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file(
            {names[j]: tensors[names[j]] for j in part}, str(folder / fname), {"format": "pt"}
        )
        weight_map.update({names[j]: fname for j in part})
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text((DATA / f"hf_{arch}.json").read_text())
    return tensors


def stored(arch: str) -> dict[str, np.ndarray]:
    got = dict(np.load(DATA / f"hf_{arch}.npz"))
    tensors = hf_weights.weights(ARCH[arch])
    assert float(got["checksum"]) == pytest.approx(hf_weights.checksum(tensors), rel=1e-12), (
        "tests/data/hf_weights.py no longer makes the weights the stored logits are for: "
        "rerun tests/data/make_hf.py (see its docstring)"
    )
    return got


# ------------------------------------------------------- a NumPy reference forward
def _rms(x, w, eps, gemma):
    y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    return y * ((1.0 + w) if gemma else w)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def reference_logits(tensors: dict[str, np.ndarray], config: dict, tokens: np.ndarray):
    """Hugging Face's Llama / Gemma forward in float64 NumPy: RMSNorm, RoPE by rotate_half,
    grouped KV heads, causal softmax attention, gated MLP (SiLU / tanh GELU)."""
    t = {k: v.astype(np.float64) for k, v in tensors.items()}
    gemma = config["model_type"] == "gemma"
    d, h, k = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, eps, base = config["head_dim"], config["rms_norm_eps"], config["rope_theta"]
    b, s = tokens.shape
    x = t["model.embed_tokens.weight"][tokens]
    if gemma:
        x = x * np.sqrt(d)
    inv = 1.0 / base ** (np.arange(0, hd, 2) / hd)
    angle = np.arange(s)[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([angle, angle], -1))[None, :, None, :]
    sin = np.sin(np.concatenate([angle, angle], -1))[None, :, None, :]
    mask = np.tril(np.ones((s, s), bool))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = _rms(x, t[p + "input_layernorm.weight"], eps, gemma)
        q = (y @ t[p + "self_attn.q_proj.weight"].T).reshape(b, s, h, hd)
        kk = (y @ t[p + "self_attn.k_proj.weight"].T).reshape(b, s, k, hd)
        v = (y @ t[p + "self_attn.v_proj.weight"].T).reshape(b, s, k, hd)
        q, kk = q * cos + _rotate_half(q) * sin, kk * cos + _rotate_half(kk) * sin
        kk, v = np.repeat(kk, h // k, axis=2), np.repeat(v, h // k, axis=2)
        scores = np.einsum("bqhd,bshd->bhqs", q, kk) / np.sqrt(hd)
        scores = np.where(mask, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = np.einsum("bhqs,bshd->bqhd", probs, v).reshape(b, s, h * hd)
        x = x + ctx @ t[p + "self_attn.o_proj.weight"].T
        y = _rms(x, t[p + "post_attention_layernorm.weight"], eps, gemma)
        g = y @ t[p + "mlp.gate_proj.weight"].T
        if gemma:
            act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
        else:
            act = g / (1 + np.exp(-g))
        x = x + (act * (y @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    x = _rms(x, t["model.norm.weight"], eps, gemma)
    head = t["model.embed_tokens.weight"] if gemma else t["lm_head.weight"]
    return x @ head.T


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_numpy_reference_forward_gives_transformers_logits(arch):
    want = stored(arch)
    config = json.loads((DATA / f"hf_{arch}.json").read_text())
    config["rope_theta"] = config.get("rope_theta", config["rope_parameters"]["rope_theta"])
    got = reference_logits(hf_weights.weights(ARCH[arch]), config, want["tokens"])
    np.testing.assert_allclose(got, want["logits"], atol=1e-4, rtol=0)


# ------------------------------------------------- the decoder under the presets
def _logits(strategy, model, tokens):
    reps = strategy.num_replicas_in_sync
    batch = np.tile(tokens, (-(-reps // len(tokens)), 1))[: max(reps, len(tokens))]
    out = strategy.run(lambda m, t: m(t), args=(model, batch))
    return np.asarray(out)[: len(tokens)]


def _layouts(model):
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model).to_pure_dict())
    return {jax.tree_util.keystr(p): dtensor.fetch_layout(v) for p, v in leaves}


CASES = {
    "llama-fsdp": ("llama", False, lambda cfg: strategies.FullyShardedStrategy(min_shard_bytes=0)),
    "llama-tensor2-scan": (
        "llama",
        True,
        lambda cfg: strategies.HybridStrategy(fsdp=2, tensor=2, rules=tensor_rules(cfg)),
    ),
    "gemma-tensor2": (
        "gemma",
        False,
        lambda cfg: strategies.HybridStrategy(tensor=2, rules=tensor_rules(cfg)),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decoder_loaded_under_a_preset_gives_transformers_logits_and_saves_the_same(case, tmp_path):
    arch, scan, make = CASES[case]
    tensors = write_hf(tmp_path / "hf", arch)
    cfg = from_hf_config(tmp_path / "hf", attention="xla", scan=scan)
    strategy = make(cfg)
    model = strategy.create(lambda: Decoder(cfg, rngs=nnx.Rngs(7)))
    before = _layouts(model)
    stats: dict = {}
    assert load_safetensors(tmp_path / "hf", model, mapping=hf_mapping(cfg), stats=stats) is model
    assert stats["bytes_read"] == sum(v.nbytes for v in tensors.values())
    assert _layouts(model) == before  # filled in the preset's layouts
    want = stored(arch)
    np.testing.assert_allclose(
        _logits(strategy, model, want["tokens"]), want["logits"], atol=1e-4, rtol=0
    )
    # Written back tensor by tensor under the same names: the same bytes, as transformers reads.
    save_safetensors(tmp_path / "out", model, mapping=hf_mapping(cfg), max_shard_size="100KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(tensors)
    back = {}
    for f in set(index["weight_map"].values()):
        back.update(load_file(tmp_path / "out" / f))
    for name, value in tensors.items():
        assert back[name].tobytes() == value.tobytes(), name


def test_from_hf_config_reads_transformers_configs_and_refuses_what_the_decoder_lacks():
    llama = from_hf_config(DATA / "hf_llama.json")
    assert (llama.block, llama.heads, llama.kv_heads, llama.head_dim, llama.tied) == (
        "llama",
        4,
        2,
        16,
        False,
    )
    gemma = from_hf_config(json.loads((DATA / "hf_gemma.json").read_text()))
    assert gemma.block == "gemma" and gemma.tied
    base = json.loads((DATA / "hf_llama.json").read_text())
    with pytest.raises(ValueError, match=r"attention_bias=True: the decoder's projections"):
        from_hf_config({**base, "attention_bias": True})
    with pytest.raises(ValueError, match=r"model_type='gpt2'; from_hf_config reads"):
        from_hf_config({**base, "model_type": "gpt2"})
    with pytest.warns(UserWarning, match=r"RoPE scaling"):
        from_hf_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    moe = from_hf_config(
        {**base, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    )
    names = hf_mapping(moe.replace(scan=True)).checkpoint_names("layers/moe/experts/up", (2, 4))
    assert names[:2] == [
        "model.layers.0.block_sparse_moe.experts.0.w3.weight",
        "model.layers.0.block_sparse_moe.experts.1.w3.weight",
    ]


# ------------------------------------------------------------- Flax's own Gemma
def test_flax_gemma_example_loads_hugging_face_gemma3_names_and_saves_them_back(tmp_path):
    """Flax's own Gemma 3, filled from Gemma 3 names, gives the logits ``transformers``'
    ``Gemma3ForCausalLM`` computed for the same weights (tests/data/hf_gemma3.npz: sliding
    and global layers, their two RoPE bases, query/key norms), and saves the same bytes."""
    from benchmarks import flax_gemma_model as fg
    from benchmarks import third_party
    from examples.hf import flax_gemma_mapping

    try:
        third_party.gemma_dir()
    except third_party.MissingThirdParty as err:
        pytest.skip(str(err))
    fcfg = fg.config("tiny")
    spec = hf_weights.GEMMA3  # the same model, as transformers configures it
    assert (fcfg.num_embed, fcfg.embed_dim, fcfg.hidden_dim, fcfg.num_layers) == (
        spec["vocab_size"],
        spec["hidden_size"],
        spec["intermediate_size"],
        spec["num_hidden_layers"],
    )
    assert (fcfg.num_heads, fcfg.num_kv_heads, fcfg.head_dim, fcfg.sliding_window_size) == (
        spec["num_attention_heads"],
        spec["num_key_value_heads"],
        spec["head_dim"],
        spec["sliding_window"],
    )
    assert (fcfg.local_base_frequency, fcfg.global_base_frequency, fcfg.global_scale_factor) == (
        spec["rope_local_base_freq"],
        spec["rope_theta"],
        spec["rope_scaling"]["factor"],
    )
    transformer, _, _ = fg.flax_gemma()
    h, k, hd, d = fcfg.num_heads, fcfg.num_kv_heads, fcfg.head_dim, fcfg.embed_dim
    want = stored("gemma3")
    tensors = hf_weights.weights(spec)
    save_file(tensors, str(tmp_path / "model.safetensors"), {"format": "pt"})
    mesh = dtensor.create_mesh([("fsdp", 8)])
    abstract = nnx.eval_shape(lambda: transformer.Transformer(fcfg, rngs=nnx.Rngs(0)))
    with mesh:
        model = load_safetensors(tmp_path, abstract, mapping=flax_gemma_mapping(fcfg))
    attn = model.layers[1].attn
    q = np.asarray(attn.q_einsum.kernel.get_value())  # [heads, d, head_dim]
    np.testing.assert_array_equal(
        q, tensors["model.layers.1.self_attn.q_proj.weight"].reshape(h, hd, d).transpose(0, 2, 1)
    )
    kv = np.asarray(attn.kv_einsum.kernel.get_value())  # [2, kv_heads, d, head_dim]
    v = tensors["model.layers.1.self_attn.v_proj.weight"].reshape(k, hd, d).transpose(0, 2, 1)
    np.testing.assert_array_equal(kv[1], v)
    tokens = want["tokens"]  # 16 tokens: past the sliding window of 8
    mask = np.ones(tokens.shape, bool)
    logits, _ = model(
        tokens,
        transformer.build_positions_from_mask(mask),
        None,
        transformer.make_causal_attn_mask(mask),
    )
    np.testing.assert_allclose(np.asarray(logits), want["logits"], atol=1e-4, rtol=0)
    save_safetensors(tmp_path / "back", model, mapping=flax_gemma_mapping(fcfg))
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(tensors)
    assert all(back[n].tobytes() == tensors[n].tobytes() for n in tensors)


# ------------------------------------------------- train.py --init-from --export-hf
TRAIN = dict(steps=3, seq=16, batch=8, seed=0)


def run_train_py(folder: Path, *, launch: int = 0) -> dict:
    """``examples/train.py --init-from`` the tiny Llama (written into ``folder/hf``) with
    ``--export-hf folder/export``, on one process or ``launch`` processes of dtensor.launch."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    if not (folder / "hf").exists():
        write_hf(folder / "hf", "llama")
    cmd = [sys.executable, str(root / "examples" / "train.py"), "--init-from", str(folder / "hf")]
    cmd += ["--export-hf", str(folder / "export"), "--strategy", "fully_sharded"]
    cmd += ["--steps", str(TRAIN["steps"]), "--seq-len", str(TRAIN["seq"])]
    cmd += ["--batch-size", str(TRAIN["batch"]), "--seed", str(TRAIN["seed"])]
    cmd += ["--out", str(folder / "run"), "--fresh", "--sample-chars", "2", "--json"]
    cmd += ["--save-every", "0"]
    if launch:
        cmd = [sys.executable, "-m", "dtensor.launch", "-n", str(launch), "--", *cmd]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420, cwd=folder)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if '"init_from"' in ln][-1]
    return json.loads(line[line.index("{") :])  # under the launcher: "[rank 0] {...}"


def one_process_run(tmp_path_factory) -> tuple[Path, dict]:
    """:func:`run_train_py` on one process, made once a run (whichever test asks first)."""
    from tests.once import once

    def make(folder: Path) -> tuple[Path, dict]:
        return folder, run_train_py(folder)

    return once(tmp_path_factory, "train-py-init-from-export-hf", make)


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory) -> tuple[Path, dict]:
    """One train.py run for the tests below."""
    return one_process_run(tmp_path_factory)


def _reference_config(path: Path) -> dict:
    config = json.loads(path.read_text())
    config["rope_theta"] = config.get("rope_theta", config["rope_parameters"]["rope_theta"])
    return config


def _first_batch() -> dict[str, np.ndarray]:
    """The batch train.py trains its first step on: its corpus through its Grain pipeline."""
    from examples import corpus

    class OneProcess:  # the InputContext of a one-process run
        input_pipeline_id, num_input_pipelines = 0, 1

        def get_per_pipeline_batch_size(self, global_batch: int) -> int:
            return global_batch

    data = corpus.encode(corpus.build_corpus())
    return corpus.windows_dataset(data, TRAIN["seq"], TRAIN["seed"], OneProcess(), TRAIN["batch"])[
        0
    ]


def _cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return float((logz - picked).mean())


@pytest.mark.slow
def test_train_py_fine_tunes_from_a_hugging_face_checkpoint(fine_tuned):
    """The first step's loss is the checkpoint's own: Hugging Face's forward (the NumPy
    reference, checked against transformers above) on the first batch. A run that skipped
    the load (a random model's loss falls too) starts at 5.473 instead of 5.504 here: 300
    times the tolerance."""
    folder, result = fine_tuned
    assert result["init_from"] == str(folder / "hf")
    batch = _first_batch()
    tensors = hf_weights.weights(hf_weights.LLAMA)
    logits = reference_logits(tensors, _reference_config(folder / "hf" / "config.json"), batch["x"])
    want = _cross_entropy(logits, batch["y"])
    assert result["loss_first"] == pytest.approx(want, abs=1e-4), (result["loss_first"], want)
    assert result["steps"] == 3 and result["loss_last"] < result["loss_first"]


@pytest.mark.slow
def test_train_py_exports_the_fine_tuned_model_as_a_hugging_face_folder(fine_tuned):
    """--export-hf writes --init-from's config.json and the trained weights (the run's own
    final checkpoint, through hf_mapping) under Hugging Face's names; Hugging Face's forward
    on them gives the trained decoder's logits (transformers' own too, where installed)."""
    folder, result = fine_tuned
    export = folder / "export"
    assert result["export_hf"] == str(export)
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((export / "config.json").read_text())
    source = json.loads((folder / "hf" / "config.json").read_text())
    assert config == {**source, "torch_dtype": "float32", "tie_word_embeddings": False}
    exported = load_file(export / "model.safetensors")
    original = hf_weights.weights(hf_weights.LLAMA)
    assert sorted(exported) == sorted(original)
    assert all(exported[n].dtype == np.float32 for n in exported)
    moved = [n for n in original if not np.array_equal(exported[n], original[n])]
    assert len(moved) == len(original), "training changed every tensor"
    # The exported tensors are the run's trained weights (its last checkpoint, step 3).
    trained = dtensor.checkpoint.restore(result["checkpoints"])["model"]
    cfg = from_hf_config(export, attention="xla")
    host = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), trained)
    back = load_safetensors(export, host, mapping=hf_mapping(cfg))
    pairs = zip(jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(trained), strict=True)
    for (p, got), want in pairs:
        np.testing.assert_array_equal(got, np.asarray(want), err_msg=jax.tree_util.keystr(p))
    # Hugging Face's forward on the exported folder = the trained decoder's forward.
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    with dtensor.create_mesh([("fsdp", 8)]):
        model = load_safetensors(export, abstract, mapping=hf_mapping(cfg))
    tokens = stored("llama")["tokens"]
    reference = reference_logits(exported, _reference_config(export / "config.json"), tokens)
    np.testing.assert_allclose(np.asarray(model(tokens)), reference, atol=1e-4, rtol=0)
    try:
        import torch
        import transformers
    except ImportError:
        return  # not in the suite's environment: tests/data/make_hf.py --check DIR does it
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export).float().eval()
    with torch.no_grad():
        theirs = hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(theirs, reference, atol=1e-4, rtol=0)


def test_train_py_refuses_export_hf_for_the_character_level_model(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "examples" / "train.py"), "--export-hf", str(tmp_path / "x")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "--export-hf" in proc.stderr and "has no Hugging Face architecture" in proc.stderr
    assert "--init-from PATH --export-hf DIR" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()  # nothing ran


def test_an_integer_tensor_is_not_read_into_float_weights_unless_asked(tmp_path):
    """An int32 norm (logits off by 63 when it loaded silently) names itself; load_dtype= asks."""
    tensors = hf_weights.weights(hf_weights.LLAMA)
    tensors["model.norm.weight"] = np.round(tensors["model.norm.weight"]).astype(np.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = from_hf_config(hf_weights.LLAMA)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    with dtensor.create_mesh([("fsdp", 8)]):
        with pytest.raises(
            dtensor.checkpoint.CheckpointError,
            match=r"tensor 'model.norm.weight' in 'model.safetensors' is stored as int32, but "
            r"'final_norm/scale' is float32: int32 -> float32 is not a lossless float widening"
            r".*hf_mapping\(cfg, load_dtype='float32'\)",
        ):
            load_safetensors(tmp_path, abstract, mapping=hf_mapping(cfg))
        model = load_safetensors(tmp_path, abstract, mapping=hf_mapping(cfg, load_dtype="float32"))
    np.testing.assert_array_equal(
        np.asarray(model.final_norm.scale.get_value()), tensors["model.norm.weight"]
    )
    # bfloat16 weights widen into the float32 model as they are (no value changes).
    import ml_dtypes

    half = {
        n: v.astype(ml_dtypes.bfloat16) for n, v in hf_weights.weights(hf_weights.LLAMA).items()
    }
    save_file(half, str(tmp_path / "model.safetensors"))
    with dtensor.create_mesh([("fsdp", 8)]):
        model = load_safetensors(tmp_path, abstract, mapping=hf_mapping(cfg))
    np.testing.assert_array_equal(
        np.asarray(model.embed.get_value()), half["model.embed_tokens.weight"].astype(np.float32)
    )


def _guide_snippet(section: str) -> str:
    """The first Python block under ``## section`` in docs/guides/pretrained.md."""
    text = (Path(__file__).resolve().parents[1] / "docs/guides/pretrained.md").read_text()
    part = text.split(f"## {section}\n", 1)[1]
    return part.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_pretrained_guides_snippets_run_as_the_guide_says(tmp_path):
    """The guide: after `pip install -e .`, from the root of a clone (no PYTHONPATH), its
    load and save snippets run as written (on a tiny checkpoint); elsewhere `examples` is
    not importable without the clone on PYTHONPATH, as it says."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    write_hf(tmp_path / "hf", "llama")
    code = _guide_snippet("Load into a preset") + _guide_snippet("Write one back")
    assert "path/to/Llama-3.2-1B" in code and '"out/"' in code
    code = code.replace("path/to/Llama-3.2-1B", str(tmp_path / "hf"))
    code = code.replace('"out/"', repr(str(tmp_path / "out")))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    run = [sys.executable, "-c", code]
    proc = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    back = load_file(tmp_path / "out" / "model.safetensors")
    tensors = hf_weights.weights(hf_weights.LLAMA)
    assert sorted(back) == sorted(tensors)
    assert all(back[n].tobytes() == v.tobytes() for n, v in tensors.items())
    elsewhere = subprocess.run(
        [sys.executable, "-c", "import examples.decoder"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert "No module named 'examples'" in elsewhere.stderr, elsewhere.stderr[-2000:]
    with_path = subprocess.run(
        [sys.executable, "-c", "import examples.decoder"],
        env={**env, "PYTHONPATH": str(root)},
        timeout=120,
        cwd=tmp_path,
    )
    assert with_path.returncode == 0


def test_a_tied_llama_checkpoint_fills_the_decoders_head_from_the_embedding(tmp_path):
    tensors = hf_weights.weights(hf_weights.LLAMA)
    del tensors["lm_head.weight"]  # tie_word_embeddings: True, as Llama 3.2 1B
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = from_hf_config({**hf_weights.LLAMA, "tie_word_embeddings": True})
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    with dtensor.create_mesh([("fsdp", 8)]):
        model = load_safetensors(tmp_path, abstract, mapping=hf_mapping(cfg))
    embed = tensors["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(model.head.get_value()), embed.T)
    save_safetensors(tmp_path / "out", model, mapping=hf_mapping(cfg))
    back = load_file(tmp_path / "out" / "model.safetensors")
    np.testing.assert_array_equal(back["lm_head.weight"], embed)  # untied once saved
