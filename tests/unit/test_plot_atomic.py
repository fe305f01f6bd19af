"""``python -m cluster plot --out x.png`` writes its PNG atomically: a save that fails part way (a full disk,
a crash in the renderer, an interrupt) leaves the PNG it would replace whole, and no temporary file."""

from __future__ import annotations

import os
import pathlib
import struct
import uuid
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure

from cluster.inspect import plot
from cluster.run.storage import Storage

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Rows:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def to_pylist(self) -> list[dict[str, Any]]:
        return self.rows


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> Storage:
    """A run with a few steps of metrics (read through the functions plot uses)."""
    rows = [
        {"kind": "step", "attempt": 0, "global_step": s, "loss": 1.0 / s, "samples_per_s": 100.0 + s}
        for s in range(1, 6)
    ]
    monkeypatch.setattr(plot, "read_metrics", lambda storage: Rows(rows))
    monkeypatch.setattr(plot, "read_run_json", lambda storage: {"name": "atomic"})
    monkeypatch.setattr(plot, "read_events", lambda storage: [])
    return Storage(f"memory://plot-{uuid.uuid4().hex}/run")


def png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[-12:-4] == b"\x00\x00\x00\x00IEND", "not a whole PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_a_plot_writes_a_whole_png_and_no_temporary_file(run: Storage, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "loss.png"
    assert plot.plot_png(run, str(out)) == (1000, 400)
    assert png_size(out) == (1000, 400) and os.listdir(tmp_path) == ["loss.png"]
    assert plot.plot_png(run, str(out)) == (1000, 400)  # replaced in place
    assert os.listdir(tmp_path) == ["loss.png"]


def test_a_save_that_fails_part_way_keeps_the_old_png_whole(
    run: Storage, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "loss.png"
    plot.plot_png(run, str(out))
    old = out.read_bytes()
    real = Figure.savefig

    def torn(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        """The renderer writes half the PNG, then fails (a full disk, a crash)."""
        real(self, fname, *args, **kwargs)
        if isinstance(fname, (str, os.PathLike)):
            os.truncate(fname, os.path.getsize(fname) // 2)
        else:
            fname.truncate(fname.tell() // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", torn)
    with pytest.raises(OSError, match="No space left"):
        plot.plot_png(run, str(out))
    assert out.read_bytes() == old, "the failed plot tore the PNG it was replacing"
    assert os.listdir(tmp_path) == ["loss.png"], "a temporary file outlived the failure"


def test_a_plot_interrupted_mid_save_keeps_the_old_png(
    run: Storage, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "loss.png"
    out.write_bytes(b"the old plot")

    def interrupted(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(fname, (str, os.PathLike)):
            pathlib.Path(fname).write_bytes(b"\x89PNG half")
        else:
            fname.write(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", interrupted)
    with pytest.raises(KeyboardInterrupt):
        plot.plot_png(run, str(out))
    assert out.read_bytes() == b"the old plot" and os.listdir(tmp_path) == ["loss.png"]
