"""A real S3 on loopback: ``moto_server`` in a subprocess, one per test, killed in a ``finally``.

    def test_x(moto_s3: MotoS3) -> None:
        Storage(f"s3://{moto_s3.bucket}/runs", moto_s3.options)

``MotoS3.stop()`` / ``start()`` kill the server and bring it back on the same port (an outage). moto keeps
its data in memory, so a restarted server is empty; ``start`` creates the bucket again. Clients reach moto
through a small TCP relay on the public port, opened only once the bucket exists: a client retrying during
the outage never sees a server without its bucket. ``pause()`` / ``resume()`` close and reopen only the
relay: an outage that keeps the data.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

MOTO_BIN = os.path.join(os.path.dirname(sys.executable), "moto_server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _s3fs_options(endpoint: str) -> dict[str, Any]:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


class Relay:
    """TCP relay 127.0.0.1:port -> 127.0.0.1:target. ``close`` refuses new connections and cuts open ones."""

    def __init__(self, port: int, target: int) -> None:
        self.target = target
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        with self.lock:
            conns, self.conns = self.conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


class MotoS3:
    """One moto_server process on 127.0.0.1:port, plus the options s3fs needs to reach it."""

    def __init__(self, port: int, bucket: str = "bucket", log_path: str | None = None) -> None:
        self.port = port
        self.bucket = bucket
        self.endpoint = f"http://127.0.0.1:{port}"
        self.log_path = log_path or os.devnull
        self.proc: subprocess.Popen[bytes] | None = None
        self.relay: Relay | None = None
        self.inner_port = 0

    @property
    def options(self) -> dict[str, Any]:
        """fsspec storage_options for s3fs (no region: moto refuses a location constraint on mkdir)."""
        return _s3fs_options(self.endpoint)

    @property
    def direct_options(self) -> dict[str, Any]:
        """Options that reach moto_server itself, past the relay: for a test that never cuts the line
        (``pause``, ``stop``). The relay's threads share this process's GIL with s3fs's event loop, which
        makes every request slower (benchmarks/LOG.md, 2026-12-07)."""
        return _s3fs_options(f"http://127.0.0.1:{self.inner_port}")

    def url(self, path: str = "") -> str:
        return f"s3://{self.bucket}/{path}".rstrip("/")

    def start(self, timeout: float = 30.0) -> None:
        assert self.proc is None, "already running"
        self.inner_port = free_port()
        inner = f"http://127.0.0.1:{self.inner_port}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [MOTO_BIN, "-H", "127.0.0.1", "-p", str(self.inner_port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"moto_server on port {self.port} exited; see {self.log_path}")
            try:
                urllib.request.urlopen(f"{inner}/moto-api/", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"moto_server on port {self.port} did not answer within {timeout}s"
                    ) from None
                time.sleep(0.1)
        req = urllib.request.Request(f"{inner}/{self.bucket}", method="PUT")
        urllib.request.urlopen(req, timeout=5).read()
        self.resume()

    def pause(self) -> None:
        """Refuse connections and cut open ones; the server and its data stay."""
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.close()

    def resume(self) -> None:
        assert self.relay is None and self.proc is not None
        self.relay = Relay(self.port, self.inner_port)

    def stop(self) -> None:
        """Kill the server (SIGKILL, like a crash); its port refuses connections until ``start``."""
        self.pause()
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def running(self) -> bool:
        return self.relay is not None and self.proc is not None and self.proc.poll() is None


@pytest.fixture
def moto_s3(tmp_path: Any) -> Iterator[MotoS3]:
    """A fresh moto S3 server with bucket ``bucket``; yields it, kills it afterwards."""
    server = MotoS3(free_port(), log_path=str(tmp_path / "moto.log"))
    for attempt in range(3):  # the free port can be taken between free_port() and bind: pick another
        try:
            server.start()
            break
        except (RuntimeError, OSError):
            if attempt == 2:
                raise
            server = MotoS3(free_port(), log_path=str(tmp_path / "moto.log"))
    try:
        yield server
    finally:
        server.stop()
