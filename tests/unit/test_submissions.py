"""Every submission of a run is recorded (``submissions/NNNNNN.json``, redacted); ``run.json`` says the config
that last started successfully, not the first one forever."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cluster.core.errors import ConfigError
from cluster.run.storage import Storage
from cluster.seam.protocol import SetupInfo
from tests.support.fakes import ScriptedGroup, make

pytestmark = [pytest.mark.timeout(60)]


class RefusingGroup(ScriptedGroup):
    def start(self, world_size: int, *args: Any, **kwargs: Any) -> list[SetupInfo]:
        raise ConfigError("task_args.d_model=128 does not fit the run's checkpoint")


def test_each_submission_is_recorded_and_run_json_follows_the_last_that_started(tmp_path: Any) -> None:
    url, base = str(tmp_path / "runs"), ["name=r", "storage.options={'key': 'hunter22'}"]
    first, _ = make({}, [f"storage.url={url}", "training.epochs=1", *base])
    first.run()
    again, _ = make({}, [f"storage.url={url}", "training.epochs=2", *base])
    again.run()
    refused, _ = make({}, [f"storage.url={url}", "training.epochs=3", *base], group_cls=RefusingGroup)
    with pytest.raises(ConfigError):
        refused.run()
    run = Storage(f"{url}/r")
    subs = [json.loads(run.read_bytes(f"submissions/{n}")) for n in sorted(run.listdir("submissions"))]
    assert [s["submission"] for s in subs] == [1, 2, 3]
    assert [s["config"]["training"]["epochs"] for s in subs] == [1, 2, 3]
    assert all(s["config"]["storage"]["options"] == {"key": "***"} for s in subs)
    info = json.loads(run.read_bytes("run.json"))
    assert info["config"]["training"]["epochs"] == 2  # the last that started; the refused one did not
    assert "hunter22" not in run.read_bytes("run.json").decode()
