"""Notifications (``tracking.notify_url``): a real HTTP server on loopback gets one JSON POST per chosen
event, each once, through an outage; the URL never reaches run.json; a bad one is a config error."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from cluster.core.errors import ConfigError, Failure
from cluster.driver.tracking import Tracker, WebhookSink
from cluster.spec.config import resolve_notify_url
from cluster.spec.load import load_config
from tests.support.fakes import Hook, make

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook()
    yield h
    h.close()


def test_each_chosen_event_is_posted_once_through_an_outage(hook: Hook) -> None:
    sink = WebhookSink(hook.url, ["failure", "finished"], "gpt", "s3://b/runs/gpt")
    hook.refuse = "finished"  # the webhook fails after taking the first of the batch
    tracker = Tracker([sink], queue_size=100, flush_timeout_s=20)
    failure = {"event": "failure", "kind": "worker_died", "rank": 3, "step": 120, "message": "died\nmore"}
    tracker.event(failure)
    tracker.event({"event": "checkpoint", "step": 120})  # not chosen: never sent
    tracker.rows([{"kind": "step", "global_step": 121, "loss": 1.0}])  # rows never are
    tracker.event({"event": "finished", "global_step": 200, "loss": 0.5})
    deadline = time.monotonic() + 10
    while hook.refused == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    hook.refuse = None  # back: the feeder sends the batch again, skipping what was sent
    assert tracker.close({"status": "finished"}) is None
    assert [b["event"]["event"] for b in hook.got] == ["failure", "finished"]  # each once, in order
    assert hook.got[0]["text"] == "[gpt] failure: worker_died on rank 3 at step 120: died"
    assert hook.got[1]["text"] == "[gpt] finished: 200 steps, loss 0.5"
    assert hook.got[0]["run"] == "gpt" and hook.got[0]["run_url"] == "s3://b/runs/gpt"


def test_a_jobs_notifications_come_from_its_driver_and_its_url_stays_out_of_the_record(
    hook: Hook, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_HOOK_URL", hook.url)
    driver, _ = make(
        {0: [Failure("worker_died", 1, "worker_died:rank 1 died")]},
        ["tracking.notify_url=env:TEST_HOOK_URL"],
        resume={1: 4},
    )
    assert driver.run().status == "finished"
    events = [b["event"]["event"] for b in hook.got]
    assert events == ["failure", "finished"]
    assert "SECRET" not in json.dumps(driver.events.records())  # run_start holds the redacted config

    cfg = load_config(data={"tracking": {"notify_url": hook.url}})
    assert cfg.to_dict()["tracking"]["notify_url"] == f"http://{hook.url.split('/')[2]}/***"
    assert resolve_notify_url(cfg.tracking) == hook.url


def test_bad_notify_urls_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"must be an http\(s\) URL of a webhook"):
        load_config(data={"tracking": {"notify_url": "hooks.slack.com/x"}})
    with pytest.raises(ConfigError, match="env: must be followed by a variable name"):
        load_config(data={"tracking": {"notify_url": "env:"}})
    monkeypatch.delenv("NO_SUCH_HOOK", raising=False)
    cfg = load_config(data={"tracking": {"notify_url": "env:NO_SUCH_HOOK"}})  # checked where the driver runs
    with pytest.raises(ConfigError, match="the environment variable NO_SUCH_HOOK is not set"):
        resolve_notify_url(cfg.tracking)
