"""ray_cluster.yaml is a real cluster-launcher config: Ray's own schema accepts it offline, Ray rejects the
usual mistakes, and it keeps the promises the README makes (pinned versions, token auth, local dashboard)."""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "ray_cluster.yaml")

pytestmark = pytest.mark.timeout(60)


def _raw() -> dict[str, Any]:
    with open(CONFIG) as fh:
        return yaml.safe_load(fh)


def _prepare_and_validate(cfg: dict[str, Any]) -> dict[str, Any]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    return prepared


def _joined(commands: list[str]) -> str:
    return "\n".join(commands)


def test_config_passes_rays_own_validation() -> None:
    prepared = _prepare_and_validate(_raw())
    assert prepared["provider"]["type"] == "aws"
    types = prepared["available_node_types"]
    head = prepared["head_node_type"]
    assert head in types
    assert types[head]["max_workers"] == 0  # filled in by prepare_config for the head type


def test_head_is_cpu_and_gpu_worker_types_have_autoscaling_bounds() -> None:
    cfg = _raw()
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert re.match(r"^[mcr]\d", head["node_config"]["InstanceType"]), "the head is a CPU instance"
    assert head["resources"].get("CPU") == 0, "no training workers on the head"
    gpu_types = {
        name: t
        for name, t in types.items()
        if name != cfg["head_node_type"] and re.match(r"^(g\d|p\d)", t["node_config"]["InstanceType"])
    }
    assert gpu_types, "at least one GPU worker node type"
    for name, t in gpu_types.items():
        # Ray clamps a type's min_workers to its max_workers silently (see below), so check it here.
        assert 0 <= t["min_workers"] <= t["max_workers"], name
        assert t["max_workers"] >= 1, name
    assert sum(t.get("min_workers", 0) for t in types.values()) <= cfg["max_workers"]
    assert max(t["max_workers"] for t in gpu_types.values()) <= cfg["max_workers"]


def test_setup_installs_the_versions_pyproject_pins() -> None:
    with open(os.path.join(REPO, "pyproject.toml")) as fh:  # no tomllib: the project supports Python 3.10
        pins = re.findall(r'^\s*"([\w.-]+(?:\[[\w,]+\])?==[^"]+)",?$', fh.read(), flags=re.M)
    assert {p.split("[")[0].split("==")[0] for p in pins} == {"torch", "ray"}
    setup = _joined(_raw()["setup_commands"])
    for pin in pins:
        assert f"'{pin}'" in setup, f"setup_commands must install exactly {pin}"
    for package in ("pyarrow", "fsspec", "s3fs"):
        assert package in setup


def test_dashboard_is_local_only_and_token_auth_is_on_everywhere() -> None:
    cfg = _raw()
    head = _joined(cfg["head_start_ray_commands"])
    worker = _joined(cfg["worker_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    assert "0.0.0.0" not in yaml.safe_dump(cfg)
    for commands in (head, worker):
        assert "RAY_AUTH_MODE=token" in commands
        assert "RAY_AUTH_MODE=disabled" not in commands
        assert "RAY_AUTH_TOKEN_PATH=$HOME/.ray/auth_token" in commands
        assert "RAY_worker_niceness=0" in commands  # the ranks train at normal priority without privileges
    # The token reaches every node (file_mounts go to the head and every worker) at Ray's default path.
    remote, local = next(iter(cfg["file_mounts"].items()))
    assert remote.endswith("/.ray/auth_token")
    assert local.startswith("~/")
    assert "--address=$RAY_HEAD_IP:6379" in worker


def _misspell_top(cfg: dict[str, Any]) -> None:
    cfg["max_worker"] = cfg.pop("max_workers")


def _wrong_type(cfg: dict[str, Any]) -> None:
    gpu = next(t for n, t in cfg["available_node_types"].items() if n != cfg["head_node_type"])
    gpu["max_workers"] = "four"


def _unknown_head(cfg: dict[str, Any]) -> None:
    cfg["head_node_type"] = "head_gpu_typo"


def _min_over_max(cfg: dict[str, Any]) -> None:
    # Ray's check: the node types' min_workers together exceed the cluster's max_workers.
    for name, t in cfg["available_node_types"].items():
        if name != cfg["head_node_type"]:
            t["min_workers"] = t["max_workers"] = cfg["max_workers"]


def _misspell_node_type_key(cfg: dict[str, Any]) -> None:
    gpu = next(t for n, t in cfg["available_node_types"].items() if n != cfg["head_node_type"])
    gpu["min_worker"] = gpu.pop("min_workers")


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (_misspell_top, jsonschema.ValidationError, "'max_worker' was unexpected"),
        (_misspell_node_type_key, jsonschema.ValidationError, "'min_worker' was unexpected"),
        (_wrong_type, jsonschema.ValidationError, "'four' is not of type 'integer'"),
        (_unknown_head, ValueError, "`head_node_type` must be one of `available_node_types`"),
        (_min_over_max, ValueError, "smaller than the sum of `min_workers`"),
    ],
    ids=["misspelled-key", "misspelled-node-type-key", "wrong-type", "unknown-head-type", "min-over-max"],
)
def test_broken_variants_fail_with_rays_error(
    mutate: Callable[[dict[str, Any]], None], error: type[Exception], message: str
) -> None:
    cfg = _raw()
    _prepare_and_validate(cfg)  # the unbroken config passes, so the failure below is the mutation's
    mutate(cfg)
    with pytest.raises(error) as info:
        _prepare_and_validate(cfg)
    assert message in str(info.value)
