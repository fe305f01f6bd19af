"""``python -m cluster plot``: a run's loss (training, and evaluation when there is one) and throughput vs
global step, as a PNG (matplotlib, Agg).

matplotlib is optional (``pip install -e '.[plot]' (from the repository root)``); without it ``plot``
raises InspectError saying so. The PNG (a local file: ``--out``) is written to a temporary file beside it,
then renamed over it: a plot that fails or is interrupted leaves the file it would replace whole.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

from cluster.inspect.runs import InspectError, eval_rows, read_events, read_run_json
from cluster.run.logs import read_metrics
from cluster.run.storage import Storage

FIGSIZE = (10.0, 4.0)
DPI = 100

logger = logging.getLogger(__name__)


def plot_png(storage: Storage, out_path: str) -> tuple[int, int]:
    """Loss and throughput vs global step as a PNG of exactly FIGSIZE x DPI pixels; returns (width, height).

    Failures from the events are marked as dashed lines at the step they were seen.
    """
    try:
        import matplotlib
    except ImportError:
        raise InspectError(
            "plot needs matplotlib: pip install -e '.[plot]' (from the repository root)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(storage).to_pylist()
    steps = [r for r in rows if r["kind"] == "step"]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    if not steps and not epochs:
        raise InspectError(f"run {storage.root} has no metrics yet (metrics/ is empty)")
    name = str(read_run_json(storage).get("name") or storage.root.rsplit("/", 1)[-1])
    failures = [e.get("step") for e in read_events(storage) if e.get("event") == "failure"]

    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=FIGSIZE, dpi=DPI)
    try:
        for attempt in sorted({r["attempt"] for r in steps}):
            part = [r for r in steps if r["attempt"] == attempt]
            ax_loss.plot(
                [r["global_step"] for r in part],
                [r["loss"] for r in part],
                lw=1,
                label=f"step loss (attempt {attempt})",
            )
            ax_tput.plot(
                [r["global_step"] for r in part],
                [r["samples_per_s"] for r in part],
                lw=1,
                label=f"attempt {attempt}",
            )
        if epochs:
            ax_loss.plot(
                [r["global_step"] for r in epochs],
                [r["loss"] for r in epochs],
                "o",
                color="black",
                label="epoch mean loss",
            )
            ax_tput.plot(
                [r["global_step"] for r in epochs],
                [r["samples_per_s"] for r in epochs],
                "o",
                color="black",
                label="epoch mean",
            )
        evals = eval_rows(rows)
        if evals:
            ax_loss.plot(
                [r["global_step"] for r in evals],
                [r["loss"] for r in evals],
                "s-",
                color="tab:green",
                ms=4,
                label="eval loss",
            )
        for step in failures:
            if isinstance(step, int):
                for ax in (ax_loss, ax_tput):
                    ax.axvline(step, color="red", ls="--", lw=1)
        ax_loss.set(title=f"{name}: loss", xlabel="global step", ylabel="loss")
        ax_tput.set(title=f"{name}: throughput", xlabel="global step", ylabel="samples/s")
        for ax in (ax_loss, ax_tput):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        save_atomic(fig, out_path)
        width, height = fig.canvas.get_width_height()
    finally:
        plt.close(fig)
    return width, height


def save_atomic(fig: Any, out_path: str) -> None:
    """Save ``fig`` as a PNG at ``out_path`` (a local file): written to a temporary file in the same folder,
    synced, then renamed over ``out_path`` (atomic), so readers see the old file or the new one, never a
    torn PNG. The temporary file never outlives a failure. No bbox_inches="tight": it would change the size.
    """
    folder, base = os.path.split(os.path.abspath(out_path))
    tmp = os.path.join(folder, f".{base}.tmp-{os.getpid()}-{random.randrange(1 << 30)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for savefig
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, dpi=DPI, format="png")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out_path)
    except BaseException:  # (re-raised) whatever stopped it, the temporary file goes
        _discard(tmp)
        raise


def _discard(tmp: str) -> None:
    """Remove the temporary file of a failed save; a failure to is logged (the save's error is raised)."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove the temporary file %s: %s", tmp, exc)
