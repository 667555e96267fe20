"""What one request came to: the mutable Call it is while it is served, the frozen Outcome it ends as.

Admission and dispatch fill the Call as they go (the relay fills its Exchange); when the answer is known (at
once, or when a stream ends) `conclude` turns it into an Outcome, which the Bookkeeper (router/bookkeeping.py)
records once into the metrics, the revision windows, the dashboard's series and the access log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from llmdeploy.router.relay import Exchange

ServedBy = Literal["local", "cloud", "none"]  # "none": refused or failed before any backend answered
Endpoint = Literal["chat/completions", "completions"]


@dataclass(frozen=True)
class AttemptFailure:
    """One attempt that failed before the commit point."""

    backend: ServedBy
    kind: str  # UpstreamFailure.kind
    fault: bool  # the backend's fault (a request it rejects as invalid is not): its revision window counts it


@dataclass
class Call:
    """One request while it is served: what admission found, what the relay learns (`ex`), what dispatch did."""

    request_id: str
    endpoint: Endpoint
    ex: Exchange
    key: str = "-"
    body: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    logged_body: Any = None  # the request body, only with logging.bodies
    capability: str | None = None  # the capability gate's label, once decided
    overflow: str | None = None  # why the plan sends it to the cloud rather than local
    attempts: int = 0
    replica: str | None = None  # the local replica that committed
    failures: list[AttemptFailure] = field(default_factory=list)
    failovers: list[tuple[str, str]] = field(default_factory=list)  # (from backend, to backend)
    retries: list[str] = field(default_factory=list)  # the failure kind each cloud retry followed
    reserved: str | None = None  # a local replica counted in flight at decision time (Dispatcher.execute)
    booked: bool = False


@dataclass(frozen=True)
class Outcome:
    served_by: ServedBy
    revision: int | None  # the revision the plan was for (a cloud answer keeps it: its windows, its series)
    status: int
    error: str | None = None  # the error code the client got, or the kind that broke a committed stream
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    total_s: float = 0.0
    overflow: str | None = None
    capability: str | None = None
    replica: str | None = None
    attempts: int = 0
    broken: str | None = None  # a committed stream's failure kind (the answer ended in an error event)
    continued: str | None = None  # the backend that finished a stream after the first one broke
    completion: str | None = None  # the answer's text when it was kept (logging.bodies, a resumable stream)
    failures: tuple[AttemptFailure, ...] = ()
    failovers: tuple[tuple[str, str], ...] = ()
    retries: tuple[str, ...] = ()

    @property
    def revision_label(self) -> str:
        return "none" if self.served_by == "none" else revision_label(self.served_by, self.revision)


def revision_label(backend: str, revision: int | None) -> str:
    """The x-llmdeploy-revision value (and the metrics' revision label): "cloud" for the cloud's answers."""
    if backend == "cloud":
        return "cloud"
    return "none" if revision is None else str(revision)


def conclude(
    call: Call, now: float, status: int, served_by: ServedBy, revision: int | None, error: str | None = None
) -> Outcome:
    """The Outcome of `call`, answered with `status` by `served_by`, at monotonic time `now`."""
    ex = call.ex
    completion_tokens = ex.completion_tokens
    if completion_tokens is None and ex.content_events:
        completion_tokens = ex.content_events  # a stream without usage: one token per content event
    return Outcome(
        served_by=served_by,
        revision=revision,
        status=status,
        error=error,
        prompt_tokens=ex.prompt_tokens,
        completion_tokens=completion_tokens,
        ttft_s=ex.ttft_s,
        total_s=now - ex.started,
        overflow=call.overflow,
        capability=call.capability,
        replica=call.replica,
        attempts=call.attempts,
        broken=ex.failed_after_commit,
        continued=ex.continued,
        completion="".join(ex.text) or None,
        failures=tuple(call.failures),
        failovers=tuple(call.failovers),
        retries=tuple(call.retries),
    )
