"""No secret value is written anywhere (docs/cluster.md, "Security"): a job with secrets in ``scaling.env``,
``task_args``, ``storage.options``, ``tracking.mlflow_uri`` (a token in its query string, checked by a proxy
in front of a real ``mlflow server``) and ``tracking.notify_url`` (a webhook on loopback), submitted with
``cluster.submit`` to a real ``ray start --head``, then exported and shown. Every byte it wrote is read back:
the run's storage, MLflow's store, the export and its sidecar, the webhook's bodies, the job's entrypoint
(Ray's and every process's command line), the job's console and ``python -m cluster show``. While it
trains, the ranks' listening sockets are read from the kernel: none listens on every interface.

    pytest tests/ray/test_secrets.py
"""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from cluster import load_config, submit
from cluster.api.export import export_checkpoint
from tests.cluster.rayproc import EXCLUDES, REPO, Head, owned_pids
from tests.ray.test_tracking import MlflowServer
from tests.support.fakes import Hook

pytestmark = pytest.mark.timeout(420)

SECRETS = {
    "scaling.env": "hf_envsecret_7f3a9c",
    "task_args.api_token": "taskargs_token_5b1e2d",
    "task_args.storage_options.key": "AKIATASKARGS4E8F",
    "task_args.storage_options.secret": "taskargs_secret_91cd0a",
    "storage.options": "storage_secret_3c7b6e",
    "tracking.mlflow_uri": "mlflow_query_token_d41f88",
    "tracking.notify_url": "hookpath_secret_2a9e71",
}


class TokenProxy:
    """A tracking server behind a token in the URI's query string, as some proxies in front of MLflow
    take one: MLflow appends each endpoint to the URI, so a request reads ``/?token=T/api/2.0/...&a=b``;
    the proxy checks T and forwards ``/api/2.0/...?a=b``. Anything else (MLflow's artifact uploads, which
    drop the query) is forwarded as it is."""

    def __init__(self, upstream: str, token: str) -> None:
        prefix = f"/?token={token}"

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                path = self.path
                if path.startswith("/?token="):
                    if not path.startswith(prefix):
                        self.send_response(403)
                        self.end_headers()
                        return
                    path = path[len(prefix) :]
                    if "?" not in path:
                        path = path.replace("&", "?", 1)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("host", "content-length", "connection", "transfer-encoding")
                }
                req = urllib.request.Request(upstream + path, data=body, headers=headers, method=self.command)
                try:
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        code, data, ctype = resp.status, resp.read(), resp.headers.get("Content-Type")
                except urllib.error.HTTPError as exc:
                    code, data, ctype = exc.code, exc.read(), exc.headers.get("Content-Type")
                self.send_response(code)
                self.send_header("Content-Type", ctype or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}/?token={token}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def head() -> Iterator[Head]:
    temp = tempfile.mkdtemp(prefix="hs", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    home = tempfile.mkdtemp(prefix="hshome", dir="/tmp")
    h = Head(temp, home)
    try:
        h.start()
        yield h
    finally:
        try:
            h.stop()
        finally:
            shutil.rmtree(temp, ignore_errors=True)
            shutil.rmtree(home, ignore_errors=True)


def listeners_of_ranks(h: Head) -> dict[int, set[str]]:
    """Per rank process of ``h`` (titled ``ray::_WorkerActor``; not another test's, beside this one under
    pytest-xdist): the local addresses it listens on (hex, as the kernel's /proc/net/tcp* write them)."""
    mine = set(owned_pids([h.temp_dir]))
    tables: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for row in fh.read().splitlines()[1:]:
                parts = row.split()
                if parts[3] == "0A":
                    tables[int(parts[9])] = parts[1]
    out: dict[int, set[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) not in mine:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"_WorkerActor" not in fh.read():
                    continue
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes = {int(link[8:-1]) for link in links if link.startswith("socket:[")}
        out[int(pid)] = {tables[i] for i in inodes if i in tables}
    return out


def command_lines() -> str:
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                lines.append(fh.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return "\n".join(lines)


def every_byte(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_no_secret_value_is_written_anywhere(head: Head, tmp_path: pathlib.Path) -> None:
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "jobs.make_tabular", "--out", str(data), "--rows", "4000"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    mlflow = MlflowServer(tmp_path / "mlflow")
    mlflow.root.mkdir()
    mlflow.start()
    proxy = TokenProxy(mlflow.uri, SECRETS["tracking.mlflow_uri"])
    hook = Hook()
    storage = tmp_path / "runs"
    try:
        cfg = load_config(
            f"{REPO}/jobs/configs/tabular_cpu.yaml",
            [
                "name=secrets",
                f"storage={storage}",
                f"storage.options={{secret_note: {SECRETS['storage.options']}}}",
                f"task_args.dataset={data}",
                f"task_args.api_token={SECRETS['task_args.api_token']}",
                f"task_args.storage_options={{key: {SECRETS['task_args.storage_options.key']}, "
                f"secret: {SECRETS['task_args.storage_options.secret']}}}",
                f"scaling.env={{HF_TOKEN: {SECRETS['scaling.env']}, OMP_NUM_THREADS: '1'}}",
                "training.epochs=2",
                "training.global_batch_size=64",
                "training.log_every_steps=1",
                f"tracking.mlflow_uri={proxy.uri}",
                "tracking.mlflow_experiment=secrets",
                f"tracking.notify_url={hook.url.rsplit('/', 1)[0]}/{SECRETS['tracking.notify_url']}",
                "tracking.notify_events=[run_start, finished]",
            ],
        )
        job = submit(cfg, address=head.address, working_dir=REPO, runtime_env={"excludes": EXCLUDES})
        seen_entrypoints, seen_commands = [], []
        listeners: dict[int, set[str]] = {}
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(head.address)
        deadline = time.monotonic() + 300
        while job.status() not in ("SUCCEEDED", "FAILED", "STOPPED"):
            assert time.monotonic() < deadline, job.logs()[-3000:]
            seen_entrypoints += [j.entrypoint for j in client.list_jobs()]
            seen_commands.append(command_lines())
            for pid, found in listeners_of_ranks(head).items():
                listeners.setdefault(pid, set()).update(found)
            time.sleep(0.2)
        console = job.logs()
        assert job.status() == "SUCCEEDED", console[-4000:]
        assert "--config-file .cluster/job-" in seen_entrypoints[0]

        sidecar = export_checkpoint(str(storage / "secrets"), str(tmp_path / "export" / "model.pt"))
        assert sidecar["task_args"]["api_token"] == "***"
        show = subprocess.run(
            [sys.executable, "-m", "cluster", "show", str(storage / "secrets")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert show.returncode == 0, show.stderr
        assert "HF_TOKEN" in show.stdout

        from mlflow.tracking import MlflowClient

        (exp,) = [e for e in MlflowClient(mlflow.uri).search_experiments() if e.name == "secrets"]
        (run,) = MlflowClient(mlflow.uri).search_runs([exp.experiment_id])
        params = run.data.params
        assert (params["scaling.env.HF_TOKEN"], params["scaling.env.OMP_NUM_THREADS"]) == ("***", "1")
        assert {b["event"]["event"] for b in hook.got} == {"run_start", "finished"}
    finally:
        hook.close()
        proxy.close()
        mlflow.stop()

    written = {
        **every_byte(storage),
        **every_byte(mlflow.root),
        **every_byte(tmp_path / "export"),
        "webhook bodies": json.dumps(hook.got).encode(),
        "ray job list entrypoints": "\n".join(seen_entrypoints).encode(),
        "command lines of every process": "\n".join(seen_commands).encode(),
        "the job's console": console.encode(),
        "python -m cluster show": (show.stdout + show.stderr).encode(),
    }
    leaks = [
        f"{name} in {where}: ...{content[max(0, i - 200) : i + 60].decode(errors='replace')}"
        for where, content in written.items()
        for name, value in SECRETS.items()
        if (i := content.find(value.encode())) >= 0
    ]
    assert leaks == []
    assert len(written) > 20  # storage, MLflow's store and the export were all read
    # The rendezvous store and gloo listen on kernel-chosen ports (the ephemeral range); Ray's own worker
    # server listens on a port of Ray's worker range (10002-19999) on every interface: Ray's, not ours.
    # One node: ours are on loopback only, never on a wildcard address.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        low, high = map(int, fh.read().split())
    ours = {
        pid: [(a, int(p, 16)) for a, p in (e.rsplit(":", 1) for e in found) if low <= int(p, 16) <= high]
        for pid, found in listeners.items()
    }
    assert sum(bool(found) for found in ours.values()) >= 2, listeners  # rank 0 (store, gloo), rank 1 (gloo)
    assert all(a in ("0100007F", "00000000000000000000000001000000") for f in ours.values() for a, _ in f), (
        ours
    )
