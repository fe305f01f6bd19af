"""The embedded Ray's settings (``cluster.api.local_ray._system_config``): defaults, and a user's value
wins."""

from __future__ import annotations

import pytest

from cluster.api import local_ray

pytestmark = pytest.mark.timeout(30)


def test_defaults_when_the_user_set_nothing() -> None:
    cfg = local_ray._system_config({})
    assert cfg["raylet_client_connect_timeout_milliseconds"] == 50
    # the retry budget stays Ray's 10 s (10 attempts x 1000 ms)
    assert (
        cfg["raylet_client_connect_timeout_milliseconds"] * cfg["raylet_client_num_connect_attempts"]
        == 10_000
    )
    assert cfg["task_events_report_interval_ms"] == 0
    assert cfg["enable_metrics_collection"] is False
    assert cfg["memory_monitor_refresh_ms"] == 1000  # the OOM guard stays on, at a lower rate
    assert cfg["worker_niceness"] == 0  # Ray's 15 would put the training ranks below every daemon


def test_a_user_setting_drops_the_embedded_default_and_its_partners() -> None:
    # A user who raised only the attempts must not get 20 x 50 ms = 1 s: both connect settings go.
    cfg = local_ray._system_config({"RAY_raylet_client_num_connect_attempts": "20"})
    assert "raylet_client_num_connect_attempts" not in cfg
    assert "raylet_client_connect_timeout_milliseconds" not in cfg
    assert cfg["task_events_report_interval_ms"] == 0  # unrelated settings stay
    cfg = local_ray._system_config({"RAY_enable_metrics_collection": "1"})
    assert "enable_metrics_collection" not in cfg
    assert cfg["raylet_client_connect_timeout_milliseconds"] == 50
