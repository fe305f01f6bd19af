"""``cluster.submit``'s checks before anything reaches a cluster (the submission itself runs against a real
head in tests/cluster/test_job_submit.py)."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import pytest

from cluster import load_config, submit
from cluster.api.submit import CONFIG_DIR, entrypoint, remove_config_file, write_config_file
from cluster.core.errors import ConfigError

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


def test_storage_a_remote_cluster_cannot_share_is_refused(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="is a folder on the machine that writes it"):
        submit(CONFIG, [f"storage={tmp_path}"], address="http://10.0.0.5:8265", working_dir=REPO)
    cfg = load_config(CONFIG, ["storage=s3://bucket/runs", "storage.options={key: AKIA, secret: s}"])
    with pytest.raises(ConfigError, match="overrides go with a config file"):
        submit(cfg, ["epochs=2"], address="http://10.0.0.5:8265", working_dir=REPO)


def test_the_config_travels_as_a_file_never_on_the_command_line(tmp_path: Any) -> None:
    """The entrypoint names a file of the working directory; the file holds the whole config (the driver
    needs its secrets), is readable by its owner only, and is gone once the submission returned."""
    cfg = load_config(
        CONFIG,
        [
            "storage=s3://bucket/runs",
            "storage.options={key: AKIAEXAMPLE, secret: s3cr3tvalue}",
            "scaling.env={HF_TOKEN: hf_secret_token}",
            "task_args.password=hunter2hunter2",
        ],
    )
    rel = write_config_file(cfg, str(tmp_path))
    line = entrypoint(rel)
    assert line == f"python -m jobs.train --config-file {rel}"
    assert entrypoint(rel, takeover=True) == f"python -m jobs.train --config-file {rel} --takeover"
    path = tmp_path / rel
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_config(data=json.loads(path.read_text())) == cfg
    remove_config_file(str(tmp_path), rel)
    assert not (tmp_path / CONFIG_DIR).exists()
    # a submission that reaches no cluster leaves no file behind
    (tmp_path / "jobs").mkdir()
    with pytest.raises(ConfigError, match="no Ray cluster answers"):
        submit(cfg, address=f"http://127.0.0.1:{closed_port()}", working_dir=str(tmp_path))
    assert not (tmp_path / CONFIG_DIR).exists()


def test_a_config_file_left_out_of_the_working_directory_is_one_clear_error(
    tmp_path: Any, capsys: Any
) -> None:
    from jobs.train import main

    assert main(["--config-file", str(tmp_path / "gone.json")]) == 2
    assert "is not in the job's working directory" in capsys.readouterr().err
