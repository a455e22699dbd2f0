"""MaxText's side of :mod:`benchmarks.maxtext_side`: the configurations and the driver.

:data:`ROWS` are the MaxText configurations of the side-by-side tables (model, topology,
overrides, pinned libtpu); :data:`DRIVER` is the small program MaxText's venv runs for a row
(``train_compile`` with a ``jit_and_compile`` that also traces the step for its matmul
FLOPs) and :func:`compile_row` runs it, each row's files in its cache folder
(:func:`row_key`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE",
    "DRIVER",
    "FLOPS_VERSION",
    "LIBTPU_DIRS",
    "REPO",
    "ROWS",
    "VENV",
    "Row",
    "compile_row",
    "row_key",
    "seq_of",
]

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("MAXTEXT_VENV", "/work/.venv-maxtext"))
CACHE = Path(os.environ.get("MAXTEXT_SIDE_CACHE", Path.home() / ".cache" / "dtensor" / "maxtext"))
#: A libtpu other than the venv's: ``pip install --no-deps --target DIR libtpu==V``.
LIBTPU_DIRS = {"0.0.52": Path(os.environ.get("LIBTPU_0052", "/work/.libtpu-0.0.52"))}

#: The matmul count the driver records (2: shard_map bodies per device, Pallas kernels per
#: grid step); a cached compile with another is traced again for its FLOPs.
FLOPS_VERSION = 2

Row = tuple[str, str, tuple[str, ...], str | None]


def _row(
    size: str,
    topology: str,
    model: str,
    target: str,
    slices: int = 1,
    libtpu: str | None = "0.0.52",
    extra: tuple[str, ...] = (),
    seq: int = 1024,
) -> Row:
    overrides = (f"model_name={model}", f"compile_topology={target}", "per_device_batch_size=1")
    return (
        size,
        topology,
        (*overrides, f"max_target_length={seq}", f"compile_topology_num_slices={slices}", *extra),
        libtpu,
    )


#: ``(size, topology as the side-by-side table writes it, MaxText overrides, libtpu)``;
#: a libtpu of ``None`` is the venv's own (0.0.50.1 beside jax 0.12.0.1).
ROWS: list[Row] = [
    _row("2b", "v5e:4x4", "gemma-2b", "v5e-16"),
    _row("7b", "v5e:4x4", "gemma-7b", "v5e-16"),
    _row("gemma3-12b", "v5e:4x4", "gemma3-12b", "v5e-16"),
    _row("llama2-70b", "v5p:4x4x4", "llama2-70b", "v5p-128"),
    _row("llama2-70b", "2 x v5p:4x4x2", "llama2-70b", "v5p-64", slices=2, libtpu=None),
    _row("llama3.1-405b", "v5p:8x8x8", "llama3.1-405b", "v5p-1024"),
    # Mixtral 8x7B, expert 8 x fsdp 4 (benchmarks.experts' row; dropless, megablox).
    _row(
        "mixtral-8x7b",
        "v5p:4x4x2",
        "mixtral-8x7b",
        "v5p-64",
        libtpu=None,
        extra=("ici_expert_parallelism=8",),
    ),
    # the pipeline row: the two slices as two stages, 2 microbatches (its own topology label,
    # as rows are keyed, cached and merged by size and topology: row 4's would collide)
    _row(
        "llama2-70b",
        "2 x v5p:4x4x2 pipeline",
        "llama2-70b",
        "v5p-64",
        slices=2,
        libtpu=None,
        extra=(
            "dcn_pipeline_parallelism=2",
            "dcn_data_parallelism=1",
            "num_pipeline_microbatches=2",
        ),
    ),
    # Llama 3.1 8B at 32768 tokens, context 8 x fsdp 4 (its own topology label: row 6's
    # would collide); per_device_batch_size=1, so 32 sequences over the 32 chips
    _row(
        "llama3.1-8b",
        "v5p:4x4x2 context 32768",
        "llama3.1-8b",
        "v5p-64",
        libtpu=None,
        extra=("ici_context_parallelism=8", "ici_fsdp_parallelism=4"),
        seq=32768,
    ),
]

#: The driver the MaxText venv runs: ``driver.py REPO OUT_DIR override...``.
DRIVER = '''\
"""Written by benchmarks/maxtext_side.py: MaxText's train_compile, keeping what it compiles."""
import importlib.metadata, json, os, sys, time
repo, out, *overrides = sys.argv[1:]
sys.path.insert(0, repo)
import jax
from absl import app
from maxtext.trainers.pre_train import train_compile as tc
from maxtext.utils import max_utils, maxtext_utils
from dtensor.analysis.floor import matmul_flops
FLOPS_VERSION = int(os.environ["MAXTEXT_SIDE_FLOPS_VERSION"])


def libtpu_version():
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path:
        for info in os.listdir(os.path.dirname(os.path.dirname(path))):
            if info.startswith("libtpu-") and info.endswith(".dist-info"):
                return info[len("libtpu-") : -len(".dist-info")]
    return importlib.metadata.version("libtpu")


def jit_and_compile(func, args, kwargs, mesh, in_shardings, out_shardings, static_argnums,
                    donate_argnums, config, logical_axis_rules):
    with jax.set_mesh(mesh), logical_axis_rules:
        jitted = jax.jit(func, in_shardings=in_shardings, out_shardings=out_shardings,
                         static_argnums=static_argnums, donate_argnums=donate_argnums)
        t0 = time.perf_counter()
        traced = jitted.trace(*args, **kwargs)
        lowered = traced.lower()
    flops = matmul_flops(traced.jaxpr)
    t1 = time.perf_counter()
    if os.environ.get("MAXTEXT_SIDE_TRACE_ONLY"):  # a cached compile, its FLOPs counted anew
        path = os.path.join(out, "compiled.json")
        record = json.load(open(path))
        record.update(matmul_flops=flops, matmul_flops_version=FLOPS_VERSION)
        json.dump(record, open(path, "w"), indent=2)
        print("maxtext_side: recounted", out, flush=True)
        os._exit(0)
    options = max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags)
    compiled = lowered.compile(compiler_options=options)
    t2 = time.perf_counter()
    open(os.path.join(out, "hlo.txt"), "w").write(compiled.as_text())
    mem = compiled.memory_analysis()
    fields = ("argument", "output", "alias", "temp", "generated_code")
    total, weights, attention = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
    devices = list(mesh.devices.flat)
    record = {
        "overrides": overrides,
        "libtpu": libtpu_version(),
        "jax": jax.__version__,
        "maxtext": importlib.metadata.version("maxtext"),
        "memory": {f"{f}_size_in_bytes": int(getattr(mem, f"{f}_size_in_bytes")) for f in fields},
        "matmul_flops": flops,
        "matmul_flops_version": FLOPS_VERSION,
        "maxtext_tflops_per_device": total,
        "mesh_shape": [[str(a), int(s)] for a, s in mesh.shape.items()],
        "slices": [int(getattr(d, "slice_index", 0)) for d in devices],
        "device_kind": devices[0].device_kind,
        "trace_seconds": t1 - t0,
        "compile_seconds": t2 - t1,
    }
    json.dump(record, open(os.path.join(out, "compiled.json"), "w"), indent=2)
    print("maxtext_side: wrote", out, flush=True)
    return compiled


tc.jit_and_compile = jit_and_compile
app.run(tc.main, argv=["train_compile", *overrides])
'''


def row_key(size: str, topology: str) -> str:
    """The cache folder (and results key) of a row: ``"llama2-70b@2 x v5p:4x4x2"`` as
    ``llama2-70b_2xv5p-4x4x2``.

    Examples:
        >>> row_key("llama2-70b", "2 x v5p:4x4x2"), row_key("2b", "v5e:4x4")
        ('llama2-70b_2xv5p-4x4x2', '2b_v5e-4x4')
    """
    return f"{size}_{topology.replace(' ', '').replace(':', '-')}"


def seq_of(overrides: tuple[str, ...] | list[str]) -> int:
    """A row's sequence length: its ``max_target_length`` override (1024 without one).

    Examples:
        >>> seq_of(ROWS[0][2]), seq_of(("max_target_length=32768",)), seq_of(())
        (1024, 32768, 1024)
    """
    lengths = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("max_target_length=")]
    return lengths[-1] if lengths else 1024


def compile_row(row: Row, *, venv: Path, cache: Path, timeout: float) -> dict[str, Any]:
    """Run the driver for one row in the MaxText venv (unless its cache holds the compile);
    ``{"error": ...}`` when it fails or runs past ``timeout`` seconds."""
    size, topology, overrides, libtpu = row
    out = cache / row_key(size, topology)
    out.mkdir(parents=True, exist_ok=True)
    driver = cache / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env["MAXTEXT_SIDE_FLOPS_VERSION"] = str(FLOPS_VERSION)
    cached = (out / "compiled.json").exists() and (out / "hlo.txt").exists()
    if cached:
        record = json.loads((out / "compiled.json").read_text())
        if record.get("matmul_flops_version") == FLOPS_VERSION:
            return {"cached": True}
        env["MAXTEXT_SIDE_TRACE_ONLY"] = "1"  # trace again (seconds), keep the compile
    env.pop("TPU_LIBRARY_PATH", None)
    if libtpu is not None:
        env["TPU_LIBRARY_PATH"] = str(LIBTPU_DIRS[libtpu] / "libtpu" / "libtpu.so")
    cmd = [str(venv / "bin" / "python"), str(driver), str(REPO), str(out), *overrides]
    start = time.perf_counter()
    log_path = out / ("trace.txt" if cached else "log.txt")
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return {"error": f"compile ran past {timeout:.0f} s", "wall_seconds": timeout}
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not (out / "compiled.json").exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)[-400:]}", "wall_seconds": wall}
    return {"cached": cached, "wall_seconds": wall}
