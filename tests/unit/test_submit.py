"""``cluster.submit``'s checks before anything reaches a cluster (the submission itself runs against a real
head in tests/cluster/test_job_submit.py)."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from cluster import load_config, submit
from cluster.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "jobs/configs/tiny_cpu.yaml")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_cluster_to_submit_to_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"no Ray cluster answers at http://127\.0\.0\.1:"):
        submit(CONFIG, ["storage=/tmp/x"], address=f"http://127.0.0.1:{closed_port()}", working_dir=REPO)


def test_storage_a_remote_cluster_cannot_share_and_credentials_in_the_entrypoint_are_refused(
    tmp_path: Any,
) -> None:
    with pytest.raises(ConfigError, match="is a folder on the machine that writes it"):
        submit(CONFIG, [f"storage={tmp_path}"], address="http://10.0.0.5:8265", working_dir=REPO)
    cfg = load_config(CONFIG, ["storage=s3://bucket/runs", "storage.options={key: AKIA, secret: s}"])
    with pytest.raises(ConfigError, match=r"storage\.options would be written into the job.s entrypoint"):
        submit(cfg, address="http://10.0.0.5:8265", working_dir=REPO)
    with pytest.raises(ConfigError, match="overrides go with a config file"):
        submit(cfg, ["epochs=2"], address="http://10.0.0.5:8265", working_dir=REPO)
