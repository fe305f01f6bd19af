"""The one redaction (``cluster.core.redact``): which values of a config, a record or a message are hidden,
and which stay readable. Key names stay, values become ``***``."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.core.redact import (
    MASK,
    harmless_env,
    redact_config,
    redact_text,
    redact_tree,
    redact_url,
    remember,
    secret_key,
)
from cluster.spec.load import from_dict

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("WANDB_API_KEY", True),
        ("aws_secret_access_key", True),
        ("password", True),
        ("db_passwd", True),
        ("GOOGLE_APPLICATION_CREDENTIALS", True),
        ("Authorization", True),
        ("connection_string", True),
        ("sas_signature", True),
        ("lr", False),
        ("dataset_url", False),
        ("hidden", False),
    ],
)
def test_secret_key(name: str, secret: bool) -> None:
    assert secret_key(name) is secret


@pytest.mark.parametrize(
    ("name", "harmless"),
    [
        ("OMP_NUM_THREADS", True),
        ("NCCL_DEBUG", True),
        ("NCCL_SOCKET_IFNAME", True),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", True),
        ("GLOO_SOCKET_IFNAME", True),
        ("PYTORCH_CUDA_ALLOC_CONF", True),
        ("NCCL_AUTH_TOKEN", False),  # listed prefix, secret name
        ("HF_TOKEN", False),
        ("WANDB_PROJECT", False),  # not listed: hidden though not secret-looking
        ("OMP_NUM_THREADS_X", False),
    ],
)
def test_harmless_env(name: str, harmless: bool) -> None:
    assert harmless_env(name) is harmless


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("https://mlflow.example/api?token=abc123&x=1", "https://mlflow.example/api?token=***&x=***"),
        ("https://user:pw1234@host:5000/path", "https://***@host:5000/path"),
        ("s3://AKIA:SECRET@bucket/key?versionId=7#frag", "s3://***@bucket/key?versionId=***#***"),
        ("http://host?sig=1", "http://host?sig=***"),
        ("not a url", "not a url"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("text", "values", "shown"),
    [
        ("token: abc123def", (), "token=***"),
        ("HF_TOKEN=hf_abc123 failed", (), "HF_TOKEN=*** failed"),
        ("could not open with s3cr3t-value", {"secret": "s3cr3t-value"}, "could not open with ***"),
        ("nested xyzw-9876 here", {"client_kwargs": {"k": "xyzw-9876"}}, "nested *** here"),
        ("Authorization: Bearer eyJhbGciOi.x.y", (), "Authorization=*** ***"),
        ("GET https://u:p4ss@h/x?token=abcd failed", (), "GET https://***@h/x?token=*** failed"),
        ("epochs=3 loss: 0.5", (), "epochs=3 loss: 0.5"),
    ],
)
def test_redact_text(text: str, values: Any, shown: str) -> None:
    assert redact_text(text, values, known=False) == shown


SECRETS = {
    "env": "hf_envsecret_0001",
    "tabular_key": "AKIATASKARGS0002",
    "tabular_secret": "taskargs-secret-0003",
    "nested_pw": "deep-password-0004",
    "storage": "storage-secret-0005",
    "storage_nested": "storage-nested-0006",
    "mlflow": "mlflow-query-token-0007",
    "hook": "T000/B000/hookpath0008",
    "url_pw": "urlpassword0009",
}


def secret_config() -> dict[str, Any]:
    return {
        "task": "jobs.tasks.tabular:TabularTask",
        "task_args": {
            "lr": 0.01,
            "data": f"s3://user:{SECRETS['url_pw']}@bucket/data",
            "storage_options": {
                "key": SECRETS["tabular_key"],
                "secret": SECRETS["tabular_secret"],
                "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"},
            },
            "layers": [{"db": {"password": SECRETS["nested_pw"]}}],
        },
        "storage": {
            "url": "s3://bucket/runs",
            "options": {
                "anon": False,
                "config_kwargs": {"x": SECRETS["storage_nested"]},
                "y": SECRETS["storage"],
            },
        },
        "scaling": {"env": {"HF_TOKEN": SECRETS["env"], "OMP_NUM_THREADS": "2", "NCCL_DEBUG": "INFO"}},
        "tracking": {
            "mlflow_uri": f"http://127.0.0.1:5000/?token={SECRETS['mlflow']}",
            "notify_url": f"https://hooks.example/services/{SECRETS['hook']}",
        },
    }


def test_a_config_keeps_its_keys_and_hides_every_secret_value() -> None:
    out = redact_config(secret_config())
    text = repr(out)
    for name, value in SECRETS.items():
        assert value not in text, name
    assert out["scaling"]["env"] == {"HF_TOKEN": MASK, "OMP_NUM_THREADS": "2", "NCCL_DEBUG": "INFO"}
    assert out["task_args"]["lr"] == 0.01
    assert out["task_args"]["storage_options"] == {
        "key": MASK,
        "secret": MASK,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"},
    }
    assert out["task_args"]["layers"] == [{"db": {"password": MASK}}]
    assert out["task_args"]["data"] == "s3://***@bucket/data"
    assert out["storage"]["options"] == {"anon": MASK, "config_kwargs": {"x": MASK}, "y": MASK}
    assert out["tracking"]["mlflow_uri"] == "http://127.0.0.1:5000/?token=***"
    assert out["tracking"]["notify_url"] == "https://hooks.example/***"
    assert out["task"] == "jobs.tasks.tabular:TabularTask"


def test_job_config_to_dict_is_the_one_redaction() -> None:
    data = secret_config()
    data["storage"]["options"] = {"key": SECRETS["storage"]}
    cfg = from_dict(data)
    text = repr(cfg.to_dict())
    for name, value in SECRETS.items():
        assert value not in text, name
    assert cfg.to_dict(redact=False)["scaling"]["env"]["HF_TOKEN"] == SECRETS["env"]


def test_a_redacted_config_is_remembered_for_every_later_message() -> None:
    redact_config(secret_config())
    message = f"RuntimeError: request with {SECRETS['env']} and {SECRETS['tabular_secret']} was refused"
    assert redact_text(message) == "RuntimeError: request with *** and *** was refused"
    remember(["short"])  # shorter than 6: would mask ordinary words
    assert redact_text("a short message") == "a short message"


def test_a_record_keeps_its_fields_and_hides_secrets_in_them() -> None:
    remember(["remembered-secret-0010"])
    record = {
        "event": "failure",
        "error": "ValueError: remembered-secret-0010 rejected",
        "api_token": "abcdef",
        "url": "https://x:y123@h/p",
        "step": 3,
    }
    assert redact_tree(record) == {
        "event": "failure",
        "error": "ValueError: *** rejected",
        "api_token": MASK,
        "url": "https://***@h/p",
        "step": 3,
    }
