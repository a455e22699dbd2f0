"""Parameter-server roles (chief, ps, worker) from arguments, the launcher's variables and TF_CONFIG."""

from __future__ import annotations

import json

import pytest

from dtensor.runtime.cluster import ClusterConfigError
from dtensor.runtime.launch import _roles
from dtensor.runtime.roles import TaskRole, resolve_role


def test_process_order_is_chief_ps_workers() -> None:
    role = TaskRole("ps", 1, num_ps=2, num_workers=3)
    assert role.process_id == 2 and role.num_processes == 6
    assert [role.name_of(p) for p in range(6)] == [
        "chief",
        "ps 0",
        "ps 1",
        "worker 0",
        "worker 1",
        "worker 2",
    ]
    assert role.worker_processes == (3, 4, 5)


def test_roles_from_tf_config() -> None:
    config = {
        "cluster": {"chief": ["c:1"], "ps": ["p:1"], "worker": ["w:1", "w:2"]},
        "task": {"type": "worker", "index": 1},
    }
    role, address = resolve_role(environ={"TF_CONFIG": json.dumps(config)})
    assert (role.task_type, role.task_index, role.process_id, address) == ("worker", 1, 3, "c:1")


def test_roles_from_the_process_index() -> None:
    role, _ = resolve_role(num_ps=1, process_id=1, num_processes=4, environ={})
    assert (role.task_type, role.task_index, role.num_workers) == ("ps", 0, 2)


def test_launcher_roles() -> None:
    assert _roles(4, 1) == [("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)]
    with pytest.raises(ValueError, match="at least one ps and one worker besides the chief"):
        _roles(2, 1)


def test_role_errors() -> None:
    with pytest.raises(ClusterConfigError, match="is not a parameter-server role"):
        TaskRole("evaluator", 0, 1, 1)
    with pytest.raises(ClusterConfigError, match="out of range for the 2 'worker'"):
        TaskRole("worker", 2, 1, 2)
    with pytest.raises(ClusterConfigError, match="needs at least one ps and one worker"):
        TaskRole("chief", 0, 0, 2)
    with pytest.raises(ClusterConfigError, match="also needs task_index, num_ps and num_workers"):
        resolve_role("worker")
    with pytest.raises(ClusterConfigError, match="no parameter-server roles found"):
        resolve_role(environ={})
    with pytest.raises(ClusterConfigError, match="must list exactly one address"):
        resolve_role(
            environ={
                "TF_CONFIG": json.dumps(
                    {
                        "cluster": {"chief": [], "ps": ["p:1"], "worker": ["w:1"]},
                        "task": {"type": "ps"},
                    }
                )
            }
        )


def test_launcher_command_line_roles(capsys) -> None:
    from dtensor.runtime import launch

    with pytest.raises(SystemExit):
        launch.main(["--ps", "1", "--", "true"])
    assert "--ps and --workers go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.main(["--", "true"])
    assert "give -n N (processes), or --ps N --workers M" in capsys.readouterr().err
