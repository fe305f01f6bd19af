"""Typed errors a user can cause or meet. Each message says what was wrong and what to change.

Every class survives pickling across Ray actors (``__reduce__``), so the driver sees the same type and
message a worker raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


class ClusterError(Exception):
    """Base of every error this package raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, self.args)


class ConfigError(ClusterError, ValueError):
    """A job spec is invalid. The message names the key and the fix; nothing was started or written."""


class StorageError(ClusterError):
    """Storage could not be reached, read or written (after retries)."""


class ResourcesUnavailableError(ClusterError):
    """The cluster could not provide the resources the job asked for within the wait allowed."""


class CheckpointError(ClusterError):
    """A checkpoint is missing, torn or fails verification."""


class DivergedError(ClusterError):
    """Training diverged: the loss became NaN or infinite. Retrying as it was cannot help (a resume is
    exact, so it would diverge at the same step); the message names the step and what to change.
    ``first_step``: the first step whose loss was not finite, as far as this rank knows."""

    def __init__(self, message: str, first_step: int | None = None) -> None:
        super().__init__(message, first_step)
        self.first_step = first_step

    def __str__(self) -> str:
        return str(self.args[0])

    @property
    def detail(self) -> dict[str, Any]:
        """What the driver needs besides the message (``WorkerError.detail``)."""
        return {"first_step": self.first_step}


class WorkerError(ClusterError):
    """An exception raised by user or worker code on one rank, with its original traceback.

    ``step`` is the global step the rank was on, so the failure policy can tell a repeatable bug
    (same error, same step) from bad luck.
    """

    def __init__(
        self,
        rank: int,
        step: int,
        exc_type: str,
        message: str,
        traceback: str,
        detail: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(rank, step, exc_type, message, traceback, detail)
        self.rank = rank
        self.step = step
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        self.detail = detail or {}
        """Structured facts of the original error (``DivergedError.detail``)."""

    def __str__(self) -> str:
        return (
            f"rank {self.rank} raised {self.exc_type} at step {self.step}: {self.message}\n{self.traceback}"
        )

    @property
    def signature(self) -> tuple[str, str, int]:
        """What makes two failures "the same": type, message and step."""
        return (self.exc_type, self.message, self.step)


class TrainingFailedError(ClusterError):
    """The job gave up: failure budget exhausted or a deterministic bug. Checkpoints are left intact."""


FailureKind = Literal[
    "worker_died", "node_lost", "hang", "user_error", "start_failed", "storage", "replica_mismatch"
]


@dataclass(frozen=True)
class HangVerdict:
    """What the ranks' stacks (and steps) say about a hang."""

    suspect: int | None
    """The rank that hangs, or None when no rank stands out."""
    how: str
    """How the suspect was told apart, or why no rank could be."""
    waiting: list[int] = field(default_factory=list)
    """The ranks found waiting inside a collective."""
    keep_survivors: bool = False
    """Whether the other ranks keep their processes (a suspect, and ``failures.warm_restart``)."""
    timeout_from: str | None = None
    """Where the hang timeout came from (``cluster.driver.policy.HangWatch.timeout_and_source``)."""

    def describe(self) -> str:
        """One sentence for the failure's message and the console."""
        if self.suspect is None:
            return f"no rank stands out ({self.how}): every rank gets a fresh process"
        kept = "the others keep their processes" if self.keep_survivors else "every rank gets a fresh process"
        return f"rank {self.suspect} hangs ({self.how}); it is ended, {kept}"


@dataclass
class Failure:
    """Why a worker group stopped: what the worker group hands the driver (``WorkerGroup.classify``)."""

    kind: FailureKind
    rank: int | None
    message: str
    error: WorkerError | None = None
    hang: HangVerdict | None = None
    """A hang's suspect as the ranks' stacks tell it (``cluster.driver.hang`` judges); None for other
    failures."""


def device_broken(error: WorkerError | None) -> bool:
    """Whether a rank's raised error may have left its CUDA context unusable, so that its process must be
    replaced, not reused for a warm restart: a CUDA error (a device-side assert is sticky: every later CUDA
    call in the process fails) or an error we know nothing about. A plain Python error in user code, or an
    out-of-memory error (the allocation failed; the context is fine), leaves the process reusable."""
    if error is None:
        return True
    text = f"{error.exc_type}: {error.message}"
    return error.exc_type in ("AcceleratorError", "CudaError") or any(
        marker in text for marker in ("CUDA error", "CUDA kernel errors", "device-side assert", "cuDNN error")
    )


class LeaseHeldError(ClusterError):
    """Another job holds the run's lease and is alive (``cluster.run.lease``): this one must not write to the
    run. Its message names the job; ``takeover=True`` / ``--takeover`` takes the run from one that is gone."""


class FencedError(StorageError):
    """A newer lease generation took the run over (``cluster.run.lease``): this job may no longer write."""
