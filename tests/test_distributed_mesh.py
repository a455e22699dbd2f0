"""create_distributed_mesh: ICI x DCN axes, slice-major, tested with fake TPU/CPU devices."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils

import dtensor
from dtensor.runtime.distributed_mesh import create_distributed_mesh, device_groups


@dataclasses.dataclass(frozen=True)
class FakeTpu:
    """A TPU device as mesh_utils sees it (as JAX's own mesh_utils tests mock them)."""

    id: int
    coords: tuple[int, int, int]
    core_on_chip: int = 0
    process_index: int = 0
    slice_index: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v5 lite"


@dataclasses.dataclass(frozen=True)
class FakeCpu:
    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def v5e_slices(num_slices: int, side: int = 4) -> list[FakeTpu]:
    """``num_slices`` slices of a side x side v5e, 4 chips per host."""
    devices = []
    for s in range(num_slices):
        for i in range(side * side):
            x, y = i % side, i // side
            devices.append(
                FakeTpu(
                    id=s * side * side + i,
                    coords=(x, y, 0),
                    process_index=s * (side * side // 4) + i // 4,
                    slice_index=s,
                )
            )
    return devices


def cpu_hosts(num_processes: int, per_process: int) -> list[FakeCpu]:
    return [
        FakeCpu(id=p * 1024 + i, process_index=p)
        for p in range(num_processes)
        for i in range(per_process)
    ]


def slices_of(mesh: dtensor.Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.slice_index, otypes=[int])(mesh.devices)


def test_two_slices_data_axis_first_half_is_one_slice():
    devices = v5e_slices(2)
    # Shuffle so the order has to come from slice_index, not from the list.
    shuffled = devices[16:] + devices[:16]
    mesh = create_distributed_mesh([("data", 16)], dcn_mesh_dims=[("data", 2)], devices=shuffled)
    assert mesh.shape == {"data": 32}
    assert list(slices_of(mesh)) == [0] * 16 + [1] * 16
    # Within a slice the order is mesh_utils' topology-aware one.
    assert list(mesh.devices[:16]) == list(mesh_utils.create_device_mesh([16], devices[:16]))
    assert list(mesh.devices) == list(mesh_utils.create_hybrid_device_mesh([16], [2], devices))


def test_dcn_on_outer_axis_matches_mesh_utils():
    devices = v5e_slices(2)
    mesh = create_distributed_mesh([("data", 4), ("model", 4)], [("data", 2)], devices)
    assert mesh.shape == {"data": 8, "model": 4}
    assert (slices_of(mesh)[:4] == 0).all() and (slices_of(mesh)[4:] == 1).all()
    expected = mesh_utils.create_hybrid_device_mesh([4, 4], [2, 1], devices)
    assert (mesh.devices == expected).all()


def test_dcn_on_inner_axis_blocks_columns():
    devices = v5e_slices(2)
    mesh = create_distributed_mesh({"data": 4, "model": 4}, {"model": 2}, devices)
    assert mesh.shape == {"data": 4, "model": 8}
    s = slices_of(mesh)
    assert (s[:, :4] == 0).all() and (s[:, 4:] == 1).all()


def test_four_slices_two_by_two_and_inferred_sizes():
    devices = v5e_slices(4, side=2)
    mesh = create_distributed_mesh(
        [("data", -1), ("model", 2)], [("data", 2), ("model", -1)], devices
    )
    assert mesh.shape == {"data": 4, "model": 4}
    s = slices_of(mesh)
    assert s.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]


def test_cpu_groups_by_process_index():
    devices = cpu_hosts(2, 2)
    mesh = create_distributed_mesh([("batch", 2)], [("batch", 2)], devices[::-1])
    assert [d.process_index for d in mesh.device_list] == [0, 0, 1, 1]
    assert [d.id for d in mesh.device_list] == [0, 1, 1024, 1025]
    by, groups = device_groups(devices)
    assert by == "process_index" and [len(g) for g in groups] == [2, 2]


def test_axis_types_and_no_dcn_equals_create_mesh():
    assert create_distributed_mesh([("x", 4), ("y", 2)]) == dtensor.create_mesh(
        [("x", 4), ("y", 2)]
    )
    mesh = create_distributed_mesh([("x", 8)], [("x", 1)], axis_types="explicit")
    assert mesh.axis_types == "explicit"
    assert mesh.device_list == sorted(jax.devices(), key=lambda d: d.id)


def test_error_dcn_axis_not_in_mesh_dims():
    with pytest.raises(
        dtensor.MeshError,
        match=r"dcn_mesh_dims names axes \('replica',\) that are not in mesh_dims",
    ):
        create_distributed_mesh([("data", 16)], [("replica", 2)], v5e_slices(2))


def test_error_slice_count_mismatch():
    with pytest.raises(
        dtensor.MeshError,
        match=r"dcn_mesh_dims \{'data': 3\} multiply to 3, but the devices have 2 groups \(by slice_index\)",
    ):
        create_distributed_mesh([("data", 16)], [("data", 3)], v5e_slices(2))


def test_error_slice_size_mismatch():
    with pytest.raises(
        dtensor.MeshError,
        match=r"mesh_dims \{'data': 8\} multiply to 8, but the devices have 16 devices in each group",
    ):
        create_distributed_mesh([("data", 8)], [("data", 2)], v5e_slices(2))


def test_error_unequal_groups():
    devices = cpu_hosts(2, 2)[:3]
    with pytest.raises(
        dtensor.MeshError, match=r"groups \(by process_index\) of unequal sizes \(0: 2, 1: 1\)"
    ):
        create_distributed_mesh([("data", 2)], [("data", 2)], devices)


def test_error_bad_entries():
    with pytest.raises(
        dtensor.MeshError, match=r"dcn_mesh_dims entry \('data', 0\) is not a \(name, size\) pair"
    ):
        create_distributed_mesh([("data", 2)], [("data", 0)], cpu_hosts(2, 2))
    with pytest.raises(dtensor.MeshError, match=r"mesh_dims names \('a', 'a'\) repeat a name"):
        create_distributed_mesh([("a", 2), ("a", 1)], [("a", 2)], cpu_hosts(2, 2))
    with pytest.raises(dtensor.MeshError, match=r"mesh_dims is empty"):
        create_distributed_mesh([], [("a", 2)], cpu_hosts(2, 2))


def test_single_process_cpu_more_slices_than_present():
    with pytest.raises(
        dtensor.MeshError,
        match=r"multiply to 2, but the devices have 1 groups \(by process_index\)",
    ):
        create_distributed_mesh([("data", 4)], [("data", 2)])


@dataclasses.dataclass(frozen=True)
class FakeGpu:
    id: int
    process_index: int
    slice_index: int = 0
    platform: str = "gpu"
    device_kind: str = "H100"


def test_non_tpu_with_uniform_slice_index_groups_by_process():
    devices = [FakeGpu(id=p * 2 + i, process_index=p) for p in range(2) for i in range(2)]
    by, groups = device_groups(devices)
    assert by == "process_index" and [[d.id for d in g] for g in groups] == [[0, 1], [2, 3]]
    distinct = [dataclasses.replace(d, slice_index=d.process_index) for d in devices]
    assert device_groups(distinct)[0] == "slice_index"


def test_error_no_devices():
    with pytest.raises(dtensor.MeshError, match=r"devices is empty; pass at least one device"):
        create_distributed_mesh([("data", 2)], [("data", 1)], [])
