"""The set of instances that may receive traffic, owned by the daemon.

The daemon is the only writer (`publish`); proxies only read (`current`) and
subscribe (`subscribe`) to changes: the proxy never guesses which instances are
ready. What a proxy saw go wrong it tells the instance itself, through the
`health` its `Backend` carries (the instance's own PassiveHealth).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.dataplane.membership import RemoteHealth
    from orchestrator.health.engine_state import EngineView
    from orchestrator.health.outlier import PassiveHealth


@dataclass(frozen=True)
class Backend:
    instance_id: str  # "0", "1", ...
    host: str  # loopback address the instance binds to
    http_port: int
    grpc_port: int
    metrics_port: int
    # The instance's passive health; not part of the identity (a Backend equals
    # another with the same addresses), and None for backends nobody supervises. In a data-plane
    # worker, the daemon's, reached through the feed (dataplane/membership.py's RemoteHealth).
    health: "PassiveHealth | RemoteHealth | None" = field(default=None, compare=False, repr=False)
    # What the instance's engine last reported (its metrics, scraped by the instance).
    engine: "EngineView | None" = field(default=None, compare=False, repr=False)

    def report_failure(self, reason: str) -> None:
        """A connect failure, reset or 5xx seen by a proxy."""
        if self.health is not None:
            self.health.failure(reason)

    def report_success(self) -> None:
        if self.health is not None:
            self.health.success()

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"


Listener = Callable[[tuple[Backend, ...]], None]


class ReadyBackends:
    def __init__(self) -> None:
        self._ready: tuple[Backend, ...] = ()
        self._listeners: list[Listener] = []

    # --- daemon side -------------------------------------------------------------
    def publish(self, backends: tuple[Backend, ...]) -> None:
        """Replace the ready set; listeners run synchronously so no request sees a stale set."""
        backends = tuple(sorted(backends, key=lambda b: int(b.instance_id)))
        if backends == self._ready:
            return
        self._ready = backends
        for listener in list(self._listeners):
            listener(backends)

    # --- proxy side --------------------------------------------------------------
    def current(self) -> tuple[Backend, ...]:
        return self._ready

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)
