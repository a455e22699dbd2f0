"""The tables of :mod:`benchmarks.fsdp_scale`: its Markdown and the side by side with MaxText."""

from __future__ import annotations

from typing import Any

#: Global batch (sequences) by model size where it is not ``--batch``: MaxText's
#: ``per_device_batch_size=1`` over the 64 chips of v5p:4x4x4 (the 512 of v5p:8x8x8).
BATCH: dict[str, int] = {"llama2-70b": 64, "llama3.1-405b": 512}

#: MaxText's own peak per chip (arguments + outputs - aliased + temporaries + code) for the
#: same model, topology and global batch (seq 1024): maxtext 0.2.5 ``train_compile`` with its
#: defaults (float32 weights, bfloat16 compute, full remat, scanned layers, AdamW, fsdp over
#: every chip), jax 0.12.0.1 + libtpu 0.0.52, measured on this machine (issue 22; JAX-NOTES.md)
#: and again by :mod:`benchmarks.maxtext_side` (``results/maxtext_side.json``, held equal by
#: ``tests/test_maxtext_side.py``), which adds MaxText's step-time floor.
MAXTEXT_GIB: dict[tuple[str, str], float] = {
    ("2b", "v5e:4x4"): 4.24,
    ("7b", "v5e:4x4"): 10.65,
    ("gemma3-12b", "v5e:4x4"): 14.30,
    ("llama2-70b", "v5p:4x4x4"): 21.16,
    # 2 slices of v5p-64 (data over DCN, fsdp 32 within each): issue 30, libtpu 0.0.50.
    ("llama2-70b", "2 x v5p:4x4x2"): 42.77,
    # v5p-1024 = v5p:8x8x8, one slice, 512 x 1024: issue 30, libtpu 0.0.52.
    ("llama3.1-405b", "v5p:8x8x8"): 25.66,
}

#: The side-by-side rows (``--maxtext``): each MaxText configuration under our presets.
MAXTEXT_ROWS: list[tuple[str, str, str]] = [
    ("2b", "v5e:4x4", "bf16 + remat"),
    ("2b", "v5e:4x4", "bf16 + remat + scan"),
    ("7b", "v5e:4x4", "bf16 + remat"),
    ("7b", "v5e:4x4", "bf16 + remat + scan"),
    ("gemma3-12b", "v5e:4x4", "bf16 + remat + scan"),
    ("llama2-70b", "v5p:4x4x4", "bf16 + remat + scan"),
    # HybridStrategy's tensor size swept (2, 4, 8: each divides the 8 KV heads).
    ("llama2-70b", "v5p:4x4x4", "hybrid tensor=2 + bf16 + remat + scan"),
    ("llama2-70b", "v5p:4x4x4", "hybrid tensor=4 + bf16 + remat + scan"),
    ("llama2-70b", "v5p:4x4x4", "hybrid tensor=8 + bf16 + remat + scan"),
    # MaxText's libtpu: compiled in a venv with jax 0.12.0.1 + libtpu 0.0.52 (Python 3.13) by
    # ``python -m benchmarks.fsdp_scale --row 7b v5e:4x4 "bf16 + remat + scan"``, the row
    # merged into the results under this option name.
    ("7b", "v5e:4x4", "bf16 + remat + scan (libtpu 0.0.52)"),
    # Two slices joined by DCN: which axis spans them (HybridStrategy(across_slices=...)).
    ("llama2-70b", "2 x v5p:4x4x2", "hybrid across data + bf16 + remat + scan"),
    ("llama2-70b", "2 x v5p:4x4x2", "hybrid across fsdp + bf16 + remat + scan"),
    ("llama3.1-405b", "v5p:8x8x8", "bf16 + remat + scan"),
    # FullyShardedStrategy(gather_layers=True): each scanned layer gathered in the loop body.
    ("llama2-70b", "v5p:4x4x4", "bf16 + remat + scan + gather layers"),
    ("llama3.1-405b", "v5p:8x8x8", "bf16 + remat + scan + gather layers"),
    ("7b", "v5e:4x4", "bf16 + remat + scan + gather layers"),
    # The search's choice for 405B (benchmarks/results/search.json): tensor=4, the loss by
    # token slices (examples.decoder.fused_cross_entropy).
    ("llama3.1-405b", "v5p:8x8x8", "hybrid tensor=4 + bf16 + remat + scan + loss by tokens"),
]

#: The order ``--maxtext`` measures them in (the targets most in doubt first).
MAXTEXT_ORDER = [3, 4, 5, 6, 7, 8, 1, 0, 2, 10, 11, 12, 13, 14, 15, 16]


#: how the options are written in the README's table
OPTION_TEXT = {
    "default": "default (XLA's plan on TPU)",
    "gather at reads": "`gather_at_read=True` (+ reshard)",
    "gather at reads, reshard off": "`gather_at_read=True, reshard_after_forward=False`",
    "xla plan": "`gather_at_read=False`",
    "f32 highest": "float32, matmul precision HIGHEST",
    "bf16": "`MixedPrecision()`",
    "bf16 + remat": "`MixedPrecision()` + `remat=(Block,)`",
    "bf16 + remat + gather at reads": "`MixedPrecision()` + `remat=(Block,)` + `gather_at_read=True`",
    "bf16 + remat + scan": "`MixedPrecision()` + `remat=(Block,)`, layers in `nnx.scan`",
    "bf16 + remat + scan (libtpu 0.0.52)": "`MixedPrecision()` + `remat=(Block,)` + scan, on "
    "libtpu 0.0.52 (MaxText's)",
    "bf16 + remat + scan + gather layers": "`MixedPrecision()` + `remat=(Block,)` + scan + "
    "`gather_layers=True`",
    "bf16 + remat + scan + offload": "`MixedPrecision()` + `remat=(Block,)` + scan + "
    "`offload_optimizer=True`",
    **{
        f"hybrid tensor={t} + bf16 + remat + scan": f"`HybridStrategy(tensor={t})` (fsdp over "
        "the rest) + `MixedPrecision()` + `remat=(Block,)` + scan"
        for t in (2, 4, 8)
    },
    "hybrid tensor=4 + bf16 + remat + scan + loss by tokens": "`HybridStrategy(tensor=4)` "
    "(fsdp over the rest) + `MixedPrecision()` + `remat=(Block,)` + scan + the loss by token "
    "slices",
    "hybrid across data + bf16 + remat + scan": "`HybridStrategy(across_slices='data')` (a "
    "replica per slice, fsdp within it) + `MixedPrecision()` + `remat=(Block,)` + scan",
    "hybrid across fsdp + bf16 + remat + scan": "`HybridStrategy(across_slices='fsdp')` (fsdp "
    "over both slices) + `MixedPrecision()` + `remat=(Block,)` + scan",
}


def is_gpu(topology: str) -> bool:
    """Whether ``topology`` names NVIDIA GPUs (``h100:1x8``) rather than TPUs or ``cpu``."""
    from dtensor.gpu.specs import GPUS

    return topology.strip().lower().partition(":")[0] in GPUS


def split_slices(topology: str) -> tuple[str, int]:
    """A row's topology as ``(name, slices)``: ``"2 x v5p:4x4x2"`` is 2 slices joined by DCN.

    Examples:
        >>> split_slices("2 x v5p:4x4x2"), split_slices("v5e:4x4")
        (('v5p:4x4x2', 2), ('v5e:4x4', 1))
    """
    count, sep, name = topology.partition(" x ")
    if sep and count.strip().isdigit():
        return name.strip(), int(count)
    return topology, 1


def results_name(topologies: list[str]) -> str:
    """The results file (no ``.json``) of rows on ``topologies``: ``fsdp_scale_gpu`` for
    GPU ones (XLA:GPU), ``fsdp_scale`` for TPU and CPU ones; a mix is refused.

    Examples:
        >>> results_name(["h100:1x8", "h100:8x8"]), results_name(["v5e:4x4", "cpu"]), results_name([])
        ('fsdp_scale_gpu', 'fsdp_scale', 'fsdp_scale')
    """
    kinds = {is_gpu(t) for t in topologies}
    if len(kinds) > 1:
        raise ValueError(
            f"topologies {', '.join(topologies)} mix GPUs with TPUs/CPU; their rows go to "
            "different results files (fsdp_scale_gpu.json, fsdp_scale.json): run them apart."
        )
    return "fsdp_scale_gpu" if kinds == {True} else "fsdp_scale"


def markdown(payload: dict[str, Any], topology: str) -> str:
    """The rows of one topology as the Markdown table the README and the docs show."""
    gib = float(1 << 30)
    order = {k: i for i, k in enumerate(OPTION_TEXT)}
    rows = sorted(
        (r for r in payload["rows"] if r["topology"] == topology),
        key=lambda r: (r["size"], order.get(r["option"], len(order)), r["option"]),
    )
    unit, platform = ("GPU", "GPU") if is_gpu(topology) else ("chip", "TPU")
    out = [
        f"| model | options | peak per {unit} | ideal peak | fits HBM | comm / min "
        f"| all-gather per {unit} | gradient reductions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = OPTION_TEXT.get(r["option"], r["option"])
        if r["option"] == "default":
            name = f"default (XLA's plan on {platform})"
        if not r.get("peak_bytes_per_chip"):
            need = r.get("required_bytes")
            peak = f"≥ {need / gib:.1f} GiB" if need else "—"
            fits = "**no**" if r.get("fits") is False else "—"
            out.append(f"| {r['size']} | {name} | {peak} | — | {fits} | — | — | — |")
            continue
        reductions = ", ".join(
            f"{k} {v / gib:.2f} GiB"
            for k, v in (r.get("reduce_bytes_by_dtype") or {}).items()
            if v >= 0.005 * gib
        )
        out.append(
            f"| {r['size']} | {name} | {r['peak_bytes_per_chip'] / gib:.1f} GiB "
            f"| {r['ideal_peak_bytes_per_device'] / gib:.1f} GiB "
            f"| {'yes' if r['fits'] else '**no**'} | {_ratio(r)} "
            f"| {r['all_gather_bytes_per_device'] / gib:.1f} GiB | {reductions or '—'} |"
        )
    return "\n".join(out)


def side_by_side(payload: dict[str, Any], maxtext: dict[str, Any] | None = None) -> str:
    """The MaxText side-by-side table (Markdown) from the results' rows (``—``: not measured).

    ``maxtext``: the payload of ``maxtext_side.json`` (:mod:`benchmarks.maxtext_side`),
    MaxText's own program read by our floor code; its floor (with what bounds it) and
    MFU ceiling fill the last two columns.
    """
    gib = float(1 << 30)
    rows = {(r["size"], r["topology"], r["option"]): r for r in payload["rows"]}
    theirs = {
        (r["size"], r["topology"]): r
        for r in (maxtext or {}).get("rows", [])
        if r.get("step_time_floor_seconds")
    }
    out = [
        "| model | topology | global batch | MaxText peak per chip | ours: options | peak per chip "
        "| vs MaxText | step-time floor | MFU ceiling | MaxText's floor | MaxText's MFU ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, topology, option in MAXTEXT_ROWS:
        ref = MAXTEXT_GIB[(size, topology)]
        r = rows.get((size, topology, option), {})
        batch = r.get("global_batch") or BATCH.get(size, payload.get("global_batch", 16))
        peak = r.get("peak_bytes_per_chip")
        need = r.get("required_bytes")
        floor = r.get("step_time_floor_seconds")
        mfu = r.get("mfu_ceiling")
        if peak:
            ours, ratio = f"{peak / gib:.2f} GiB", f"{peak / gib / ref:.2f}x"
            ours += "" if r.get("fits") else " (**no fit**)"
        elif need:
            ours, ratio = f"≥ {need / gib:.1f} GiB (**no fit**)", f"≥ {need / gib / ref:.2f}x"
        else:
            ours, ratio = "—", "—"
        out.append(
            f"| {size} | {topology} | {batch} x {payload.get('seq_len', 1024)} | {ref:.2f} GiB "
            f"| {OPTION_TEXT.get(option, option)} | {ours} | {ratio} "
            f"| {'—' if not floor else f'{floor * 1e3:.0f} ms'} "
            f"| {'—' if not mfu else f'{mfu:.0%}'} | {_maxtext_floor(theirs.get((size, topology)))} |"
        )
    return "\n".join(out)


def _maxtext_floor(row: dict[str, Any] | None) -> str:
    """MaxText's floor and MFU ceiling cells: ``163 ms (ICI) | 37%`` (``— | —`` unmeasured)."""
    if not row:
        return "— | —"
    mfu = row.get("mfu_ceiling")
    floor = f"{row['step_time_floor_seconds'] * 1e3:.0f} ms ({row['step_floor']['bound']})"
    return f"{floor} | {'—' if not mfu else f'{mfu:.0%}'}"


def slices_table(payload: dict[str, Any]) -> str:
    """The rows on several slices (``"2 x v5p:4x4x2"``): peak, what crosses DCN, the floor's terms."""
    gib = float(1 << 30)
    out = [
        "| model | topology | ours: options | mesh | peak per chip | vs MaxText | over DCN per "
        "step | over ICI per step | step-time floor: compute / ICI / DCN | bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        if split_slices(r["topology"])[1] == 1 or not r.get("peak_bytes_per_chip"):
            continue
        ref = MAXTEXT_GIB.get((r["size"], r["topology"]))
        peak = r["peak_bytes_per_chip"] / gib
        dcn = ", ".join(f"{k} {v / gib:.2f}" for k, v in r.get("dcn_by_kind", {}).items())
        f = r["step_floor"]
        out.append(
            f"| {r['size']} | {r['topology']} | {OPTION_TEXT.get(r['option'], r['option'])} "
            f"| `{r['mesh']}` | {peak:.2f} GiB | {f'{peak / ref:.2f}x' if ref else '—'} "
            f"| {r['dcn_bytes_per_device'] / gib:.2f} GiB ({dcn}) "
            f"| {r['ici_bytes_per_device'] / gib:.1f} GiB "
            f"| {f['compute_seconds'] * 1e3:.0f} / {f['ici_seconds'] * 1e3:.0f} / "
            f"{f['dcn_seconds'] * 1e3:.0f} ms | {f['bound']} |"
        )
    return "\n".join(out)


def _ratio(row: dict[str, Any]) -> str:
    """comm / min, or against ZeRO's reference for rows measured before the lower bound."""
    if row.get("comm_ratio") is not None:
        return f"{row['comm_ratio']:.2f}"
    if row.get("comm_ratio_vs_zero") is not None:
        return f"{row['comm_ratio_vs_zero']:.2f} (vs ZeRO)"
    return "—"


def _plan_text(option: str) -> str:
    """A side-by-side option in a few words: the preset and what it adds to bf16 + remat."""
    preset = "`FullyShardedStrategy`"
    if option.startswith("hybrid tensor="):
        preset = f"`HybridStrategy(tensor={option.split('=')[1].split()[0]})`"
    elif option.startswith("hybrid across "):
        preset = f"`HybridStrategy(across_slices='{option.split()[2]}')`"
    extras = [
        text
        for key, text in (
            ("scan", "scanned layers"),
            ("gather layers", "`gather_layers=True`"),
            ("loss by tokens", "the loss by token slices"),
        )
        if f"+ {key}" in option
    ]
    return ", ".join([preset, *extras])


def best_plans(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model of the side by side (its one-slice topology, the pinned libtpu), the row
    with the lowest step-time floor among those that fit (ties: the lower peak)."""
    rows = {(r["size"], r["topology"], r["option"]): r for r in payload["rows"]}
    best: dict[str, dict[str, Any]] = {}
    for size, topology, option in MAXTEXT_ROWS:
        r = rows.get((size, topology, option))
        if split_slices(topology)[1] > 1 or "(libtpu" in option:
            continue
        if not r or not r.get("fits") or not r.get("step_time_floor_seconds"):
            continue
        key = (r["step_time_floor_seconds"], r["peak_bytes_per_chip"])
        held = best.get(size)
        if held is None or key < (held["step_time_floor_seconds"], held["peak_bytes_per_chip"]):
            best[size] = r
    return list(best.values())


def compact(payload: dict[str, Any], maxtext: dict[str, Any]) -> str:
    """The README's "how it compares" table: one row per model, our fastest fitting plan
    (:func:`best_plans`) against MaxText's own compile (``maxtext_side.json``): peak per chip
    and step-time floor, both read from the results files."""
    gib = float(1 << 30)
    theirs = {(r["size"], r["topology"]): r for r in maxtext["rows"]}
    out = [
        "| model | topology | MaxText: peak per chip | floor | ours: plan (+ bf16, remat) "
        "| peak per chip | vs MaxText | floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in best_plans(payload):
        mt = theirs[(r["size"], r["topology"])]
        mine, ref = r["peak_bytes_per_chip"] / gib, mt["peak_bytes_per_chip"] / gib
        out.append(
            f"| {r['size']} | {r['topology']} | {ref:.2f} GiB "
            f"| {mt['step_time_floor_seconds'] * 1e3:.0f} ms | {_plan_text(r['option'])} "
            f"| {mine:.2f} GiB | {mine / ref:.2f}x | {r['step_time_floor_seconds'] * 1e3:.0f} ms |"
        )
    return "\n".join(out)


def maxtext_libtpu(maxtext: dict[str, Any]) -> str:
    """Which libtpu compiled each MaxText row of ``maxtext_side.json``, as one sentence."""
    by: dict[str, list[str]] = {}
    for r in maxtext["rows"]:
        by.setdefault(r["libtpu"], []).append(f"{r['size']} on {r['topology']}")
    parts = [
        f"libtpu {v} compiled {len(rows)}: {', '.join(rows)}"
        for v, rows in sorted(by.items(), reverse=True)
    ]
    return (
        f"Of MaxText's {len(maxtext['rows'])} rows in `maxtext_side.json`, "
        + "; ".join(parts)
        + "."
    )
