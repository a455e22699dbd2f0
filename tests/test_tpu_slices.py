"""TPU slices as Cloud TPU builds them: names, torus links, ring order, and what they compile to.

The name table is held against every v4 / v5p / v5e / v6e slice MaxText's
``accelerator_to_spec_map`` lists (its accelerator types, chip grids and ``wrap``), written
here in our own compact form. The compile tests read the program libtpu makes for a real
slice description: on a full v4/v5p slice (a torus) a preset's FSDP weight gather is an
all-gather; described without the links, or with the devices in host order, the same
program gathers by an all-reduce of a zero-padded buffer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import mesh_utils

import dtensor
import strategies
from dtensor.tpu.slices import SliceError, accelerator_types, describe_slice
from dtensor.tpu.topology import TopologyError

ROOT = Path(__file__).resolve().parents[1]

# accelerator type's number -> chip grid, for every v5p and v4 slice MaxText lists. Full
# slices (every side a multiple of 4) are tori; the four smallest are not.
V5P = (
    "8:2x2x1 16:2x2x2 32:2x2x4 64:2x4x4 128:4x4x4 256:4x4x8 384:4x4x12 512:4x8x8 640:4x4x20 "
    "768:4x8x12 896:4x4x28 1024:8x8x8 1152:4x12x12 1280:4x8x20 1408:4x4x44 1536:8x8x12 "
    "1664:4x4x52 1792:4x8x28 1920:4x12x20 2048:8x8x16 2176:4x4x68 2304:8x12x12 2432:4x4x76 "
    "2560:8x8x20 2688:4x12x28 2816:4x8x44 2944:4x4x92 3072:8x12x16 3200:4x20x20 3328:4x8x52 "
    "3456:12x12x12 3584:8x8x28 3712:4x4x116 3840:8x12x20 3968:4x4x124 4096:8x16x16 "
    "4224:4x12x44 4352:4x8x68 4480:4x20x28 4608:12x12x16 4736:4x4x148 4864:4x8x76 "
    "4992:4x12x52 5120:8x16x20 5248:4x4x164 5376:8x12x28 5504:4x4x172 5632:8x8x44 "
    "5760:12x12x20 5888:4x8x92 6016:4x4x188 6144:12x16x16 6272:4x28x28 6400:8x20x20 "
    "6528:4x12x68 6656:8x8x52 6784:4x4x212 6912:12x12x24 7040:4x20x44 7168:8x16x28 "
    "7296:4x12x76 7424:4x8x116 7552:4x4x236 7680:12x16x20 7808:4x4x244 7936:4x8x124 "
    "8064:12x12x28 8192:16x16x16 8320:4x20x52 8448:8x12x44 8704:8x8x68 8832:4x12x92 "
    "8960:8x20x28 9216:12x16x24 9472:4x8x148 9600:12x20x20 9728:8x8x76 9856:4x28x44 "
    "9984:8x12x52 10240:16x16x20 10368:12x12x36 10496:4x8x164 10752:12x16x28 10880:4x20x68 "
    "11008:4x8x172 11136:4x12x116 11264:8x16x44 11520:12x20x24 11648:4x28x52 11776:8x8x92 "
    "11904:4x12x124 12032:4x8x188 12160:4x20x76 12288:16x16x24 13824:12x24x24 17920:16x20x28"
)
V4 = (
    "8:2x2x1 16:2x2x2 32:2x2x4 64:2x4x4 128:4x4x4 256:4x4x8 384:4x4x12 512:4x8x8 1024:8x8x8 "
    "1536:8x8x12 2048:8x8x16 4096:8x16x16"
)
# v5e / v6e: chips -> grid and the wrapped dimensions (only a side of 16 wraps).
TWO_D = {
    1: ("1x1", ()),
    4: ("2x2", ()),
    8: ("2x4", ()),
    16: ("4x4", ()),
    32: ("4x8", ()),
    64: ("8x8", ()),
    128: ("8x16", (1,)),
    256: ("16x16", (0, 1)),
}


def _table(text: str) -> list[tuple[int, str]]:
    return [(int(n), g) for n, g in (item.split(":") for item in text.split())]


@pytest.mark.parametrize("generation, table", [("v5p", V5P), ("v4", V4)])
def test_every_3d_accelerator_type_is_the_grid_and_torus_cloud_tpu_builds(generation, table):
    for cores, grid in _table(table):
        s = describe_slice(f"{generation}-{cores}")
        assert "x".join(map(str, s.grid)) == grid, (generation, cores)
        assert s.chips == cores // 2 and s.accelerator_type == f"{generation}-{cores}"
        torus = all(int(d) % 4 == 0 for d in grid.split("x"))
        assert s.wrap == (torus,) * 3, (generation, cores)
        assert s.chip_config == "megacore" and s.chips_per_host == (2, 2, 1)
        # The grid name describes the same slice.
        assert describe_slice(f"{generation}:{grid}") == s
        assert s.grid_name == f"{generation}:{grid}"
    assert describe_slice("v5p-128").wrap == (True, True, True)  # the example
    assert describe_slice("v5p-64").wrap == (False, False, False)


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_every_2d_accelerator_type_wraps_only_on_a_side_of_16(generation):
    prefixes = ["v5litepod", "v5e"] if generation == "v5e" else ["v6e"]
    for chips, (grid, wrapped) in TWO_D.items():
        for prefix in prefixes:
            s = describe_slice(f"{prefix}-{chips}")
            assert "x".join(map(str, s.grid)) == grid and s.chips == chips
            assert s.wrap == tuple(i in wrapped for i in range(3)), (prefix, chips)
            assert s.chip_config == "default"
            assert describe_slice(f"{generation}:{grid}") == s
    assert [describe_slice(t).chips for t in accelerator_types(generation)] == list(TWO_D)
    assert describe_slice("v5e-256").wrap == (True, True, False)
    assert describe_slice("v5e-128").wrap == (False, True, False)


def test_names_print_both_forms_and_overrides():
    assert str(describe_slice("v5p:4x4x4")) == "v5p-128 (v5p:4x4x4, 64 chips, torus xyz)"
    assert str(describe_slice("v5litepod-16")) == (
        "v5litepod-16 (v5e:4x4, 16 chips, no wraparound links)"
    )
    assert describe_slice("v5p-128", wrap=False).wrap == (False, False, False)
    assert describe_slice("v5e-128", wrap=(True, True)).wrap == (True, True, False)
    twisted = describe_slice("v4:4x4x8_twisted")
    assert twisted.twisted and twisted.grid_name == "v4:4x4x8_twisted" and all(twisted.wrap)
    assert not describe_slice("v4:4x4x8_untwisted").twisted
    assert describe_slice("V5P-1024 ").grid == (8, 8, 8)  # case and spaces as typed


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("v5p-100", {}, r"'v5p-100'.*no v5p slice of 50 chips.*v5p-8, v5p-16"),
        ("v5p-9", {}, r"count TensorCores, 2 a chip; 9 is not a whole number of chips"),
        ("v5e-512", {}, r"'v5e-512'.*no v5e slice of 512 chips"),
        ("v9-8", {}, r"unknown accelerator type.*v5litepod-N"),
        ("v5e:4x4x4", {}, r"a v5e grid has 2 dimensions"),
        ("v5p:4x4x4_twisted", {}, r"only k x k x 2k and k x 2k x 2k.*drop '_twisted'"),
        ("v4:4x4x8_twisted", {"wrap": False}, r"twisted torus wraps in every dimension"),
        ("v5p-128", {"wrap": "yes"}, r"wrap must be a bool.*wrap=\(True, True, True\)"),
        ("4x4", {}, r"not a TPU slice name.*'v5p-128'"),
    ],
)
def test_bad_names_say_what_cloud_tpu_builds(name, kwargs, match):
    with pytest.raises(SliceError, match=match):
        describe_slice(name, **kwargs)
    with pytest.raises(TopologyError, match=match):  # the same message from tpu_topology
        dtensor.tpu_topology(name, **kwargs)


def test_tpu_topology_takes_accelerator_types_and_describes_the_links():
    full = dtensor.tpu_topology("v5p-128")
    assert full is not dtensor.tpu_topology("v5p-128", wrap=False)
    assert dtensor.tpu_topology("v5p:4x4x4") == full  # one slice, one set of devices
    assert len(full) == 64 and {d.core_on_chip for d in full} == {0}  # megacore
    assert len({d.process_index for d in full}) == 16  # 2x2x1 chips a host
    assert len(dtensor.tpu_topology("v4-16")) == 8
    assert len(dtensor.tpu_topology("v5litepod-16")) == 16
    assert len(dtensor.tpu_topology("v4:4x4x8_twisted")) == 128


def test_a_mesh_over_explicit_tpu_devices_is_arranged_as_on_a_real_vm():
    devices = dtensor.tpu_topology("v5p-128")
    assert [d.id for d in devices[:6]] == [0, 1, 4, 5, 2, 3]  # libtpu's host order
    for shape, split in [((64,), False), ((4, 16), False), ((4, 4, 4), False), ((8, 8), True)]:
        dims = [(f"a{i}", n) for i, n in enumerate(shape)]
        mesh = dtensor.create_mesh(dims, devices=devices)
        want = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=split)
        assert [d.id for d in mesh.devices.flat] == [d.id for d in want.flat], shape
    # Given or not, on a v5e slice too (its 8-chip axis splits a side, as jax.make_mesh).
    v5e = dtensor.tpu_topology("v5e:4x4")
    mesh = dtensor.create_mesh([("data", 2), ("fsdp", 8)], devices=v5e)
    want = mesh_utils.create_device_mesh((2, 8), v5e, allow_split_physical_axes=True)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in want.flat]
    # Several slices: the hybrid arrangement, slice-major on the outer axis.
    two = dtensor.tpu_topology("v5p:2x2x2", num_slices=2)
    mesh = dtensor.create_mesh([("data", 2), ("fsdp", 8)], devices=two)
    want = mesh_utils.create_hybrid_device_mesh((1, 8), (2, 1), two)
    assert [(d.slice_index, d.id) for d in mesh.devices.flat] == [
        (d.slice_index, d.id) for d in want.flat
    ]
    # A mesh over the first of more devices keeps the given order, and says so.
    with pytest.warns(UserWarning, match=r"uses the first 8 of the 64 TPU devices given"):
        sub = dtensor.create_mesh([("x", 8)], devices=devices)
    assert [d.id for d in sub.devices.flat] == [d.id for d in devices[:8]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dtensor.create_mesh([("x", 8)], devices=devices[:8])  # all given: no warning


def _gather_kinds(devices, *, host_order: bool = False) -> dict[str, float]:
    """Bytes per device by collective kind for a preset's FSDP weight gathered for a matmul:
    a bf16 [8192, 28672] weight split over every chip (a Llama 2 70B MLP kernel)."""
    strategy = strategies.FullyShardedStrategy(devices=devices)
    mesh = strategy.mesh
    if host_order:
        jm = jax.sharding.Mesh(np.array(devices).reshape(len(devices)), ("fsdp",))
        mesh = dtensor.Mesh(jm)
    w_layout = dtensor.Layout(["fsdp", None], mesh)
    x_layout = dtensor.Layout.batch_sharded(mesh, "fsdp", 2)
    w = jax.ShapeDtypeStruct((8192, 28672), jnp.bfloat16, sharding=w_layout.sharding)
    x = jax.ShapeDtypeStruct((16 * len(devices), 8192), jnp.bfloat16, sharding=x_layout.sharding)
    report = dtensor.explain(lambda x, w: x @ w, x, w)
    assert report.compiled is not None
    return report.by_kind()


@pytest.mark.parametrize("name", ["v5p:4x4x4", "v5p:8x8x8", "v4:4x4x4"])
def test_fsdp_gather_on_a_full_slice_is_an_all_gather(name):
    kinds = _gather_kinds(dtensor.tpu_topology(name))
    # Each chip receives the weight less its own shard, once: 448 MiB less 1/n.
    n = 512 if name == "v5p:8x8x8" else 64
    assert kinds.get("all-reduce", 0) == 0, kinds
    assert kinds["all-gather"] == pytest.approx(8192 * 28672 * 2 * (n - 1) / n, rel=1e-6)


_THREE_WAYS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import dtensor
from tests.test_tpu_slices import _gather_kinds
torus = dtensor.tpu_topology("v5p:4x4x4")
out = {
    "torus": _gather_kinds(torus),
    "no_links": _gather_kinds(dtensor.tpu_topology("v5p:4x4x4", wrap=False)),
    "host_order": _gather_kinds(torus, host_order=True),
    "host_ids": [d.id for d in torus],
}
print(json.dumps(out))
"""


def test_without_the_links_or_in_host_order_the_same_gather_is_an_all_reduce():
    """What every ahead-of-time compile measured before: the program is not a real slice's.

    The three programs are compiled in one fresh process, the torus in ring order first as
    the control, so what the worker compiled before cannot change them.
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _THREE_WAYS, str(ROOT)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    gathered = 8192 * 28672 * 2 * 63 / 64
    assert got["torus"] == {"all-gather": pytest.approx(gathered, rel=1e-6)}, got
    assert set(got["no_links"]) == {"all-reduce"}, got["no_links"]
    # libtpu lists the chips host by host (2x2x1 chips a host), not around the torus.
    assert got["host_ids"][:6] == [0, 1, 4, 5, 2, 3], got["host_ids"][:16]
    assert set(got["host_order"]) == {"all-reduce"}, (got["host_order"], got["host_ids"])
    # An all-reduce of the zero-padded weight: twice the all-gather's bytes.
    assert got["no_links"]["all-reduce"] == got["host_order"]["all-reduce"] == 2 * gathered


def test_multislice_descriptions_lose_the_in_slice_torus():
    """What libtpu's multi-slice description compiles (the issue's question 3), pinned.

    Two v5p-64 slices (no links in a slice): the in-slice FSDP gather is an all-gather, as
    on one v5p-64. Two v5p-128 tori: it is an all-reduce, as on one v5p-128 described
    without its links, even over slice 0's devices alone. libtpu's multi-slice topology
    ("megascale") does not carry a slice's wraparound links into the compiler; a real job's
    runtime describes each slice from its hardware, so there we expect the one-slice
    program (the all-gather). Figures for two full v4/v5p slices are therefore upper
    bounds. If a libtpu release changes this, this test says so.
    """

    def in_slice(name: str) -> dict[str, float]:
        two = dtensor.tpu_topology(name, num_slices=2)
        mesh = dtensor.create_distributed_mesh([("data", 1), ("fsdp", -1)], [("data", 2)], two)
        w = jax.ShapeDtypeStruct(
            (8192, 28672), jnp.bfloat16, sharding=dtensor.Layout(["fsdp", None], mesh).sharding
        )
        x_layout = dtensor.Layout.batch_sharded(mesh, ("data", "fsdp"), 2)
        x = jax.ShapeDtypeStruct((16 * len(two), 8192), jnp.bfloat16, sharding=x_layout.sharding)
        return dtensor.explain(lambda x, w: x @ w, x, w).by_kind()

    small = in_slice("v5p-64")
    assert small.get("all-reduce", 0) == 0 and small["all-gather"] > 0, small
    tori = in_slice("v5p-128")
    assert tori.get("all-gather", 0) == 0 and tori["all-reduce"] > 0, tori


def test_tpu7x_slices_are_v5p_grids_with_two_devices_a_chip():
    """Ironwood (tpu7x): the accelerator types MaxText lists (the number counts TensorCores, 2
    a chip), the same grids and tori as v5p, plus tpu7x-2 (one chip); each TensorCore is a
    device, so libtpu's topology has twice as many devices as chips, two at each chip's
    coordinates, four chips a host."""
    from dtensor.analysis.hardware import chip_of

    for cores, grid in _table(V5P):
        if cores // 2 > 9216:
            continue
        s = describe_slice(f"tpu7x-{cores}")
        assert "x".join(map(str, s.grid)) == grid and s.chips == cores // 2, cores
        assert s.devices == cores and s.chip_config == "default"
        assert s.wrap == describe_slice(f"v5p-{cores}").wrap
        assert describe_slice(f"tpu7x:{grid}") == s
    one = describe_slice("tpu7x-2")
    assert (one.grid, one.devices, one.chips_per_host) == ((1, 1, 1), 2, (1, 1, 1))
    assert accelerator_types("tpu7x")[:3] == ["tpu7x-2", "tpu7x-8", "tpu7x-16"]
    assert describe_slice("ironwood:4x4x4") == describe_slice("tpu7x-128")
    devices = dtensor.tpu_topology("tpu7x-128")
    assert len(devices) == 128 and {d.device_kind for d in devices} == {"TPU7x"}
    per_chip = {}
    for d in devices:
        per_chip.setdefault(tuple(d.coords), []).append(d.core_on_chip)
    assert len(per_chip) == 64 and all(sorted(c) == [0, 1] for c in per_chip.values())
    assert len({d.process_index for d in devices}) == 16  # 4 chips (8 devices) a host
    chip = chip_of(devices)  # per device: half a chip
    assert (chip.generation, chip.peak_flops, chip.usable_hbm_gib) == ("tpu7x", 2307e12 / 2, 94.75)
    with pytest.raises(SliceError, match="tpu7x accelerator types: tpu7x-2, tpu7x-8"):
        describe_slice("tpu7x-6")
