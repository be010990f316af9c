"""A worker's view of the ready set: what the daemon published, and what passive
health took out while no daemon was there to decide.

The daemon is the only writer of membership. A worker applies each `members`
message to its own ReadyBackends (which its proxies subscribe to, as they did in
one process) and reports every upstream outcome back over the feed; the daemon's
per-instance PassiveHealth decides ejections and publishes the new set to every
worker, so a passive ejection seen by one worker ejects for all.

While the daemon is away (killed, restarting, upgrading) the worker keeps the
last set and judges on its own: `threshold` consecutive failures on one instance
eject it for AWAY_EJECT_S, written to the shared table so every worker skips it,
then it is tried again (Envoy's passive re-admission). An instance that accepts and says
nothing is found by the worker's probes meanwhile (away_probe.py). The daemon, once back,
publishes the truth and the local judgement stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from orchestrator.dataplane.shared_table import SharedTable, instance_index
from orchestrator.health.engine_state import EngineSnapshot, EngineView
from orchestrator.routing.backends import Backend, ReadyBackends

AWAY_EJECT_S = 10.0


class RemoteHealth:
    """What a proxy holds as `Backend.health` in a worker: reports go to the membership."""

    __slots__ = ("_iid", "_membership", "_failed", "served")

    def __init__(self, iid: str, membership: "WorkerMembership") -> None:
        self._iid = iid
        self._membership = membership
        self._failed = False  # the last report was a failure: the next success is news
        self.served = False  # answered since the last stats message (the canary skips busy instances)

    def failure(self, reason: str) -> None:
        self._failed = True
        self._membership.report(self._iid, False, reason)

    def success(self) -> None:
        self.served = True
        if self._failed:  # a success after a success changes nothing: not sent
            self._failed = False
            self._membership.report(self._iid, True, "")


class WorkerMembership:
    def __init__(self, backends: ReadyBackends, table: SharedTable, send: Callable[[dict[str, Any]], None],
                 threshold: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.backends = backends
        self._table = table
        self._send = send
        self.threshold = threshold
        self._clock = clock
        self._published: tuple[Backend, ...] = ()
        self._health: dict[str, RemoteHealth] = {}
        self._views: dict[str, EngineView] = {}
        self._streaks: dict[str, int] = {}
        self.daemon_connected = False
        self.ejected_away: set[str] = set()  # ejected by this data plane while the daemon was away

    # --- from the daemon -------------------------------------------------------------
    def on_members(self, members: list[dict[str, Any]]) -> None:
        out = []
        for m in members:
            iid = str(m["id"])
            health = self._health.get(iid) or self._health.setdefault(iid, RemoteHealth(iid, self))
            view = self._views.get(iid) or self._views.setdefault(iid, EngineView())
            out.append(Backend(iid, m["host"], int(m["http"]), int(m["grpc"]), int(m["metrics"]),
                               health=health, engine=view))
        gone = set(self._views) - {b.instance_id for b in out}
        for iid in gone:  # it restarts: its engine numbers and failure streak are void
            self._views.pop(iid).clear()
            self._health.pop(iid, None)
            self._streaks.pop(iid, None)
        self._published = tuple(out)
        self.ejected_away.clear()  # the daemon's set is the truth again
        self.refresh()

    def published(self) -> tuple[Backend, ...]:
        """The daemon's last set, local ejections included (what the away prober checks)."""
        return self._published

    def on_engine(self, iid: str, snapshot: dict[str, Any], routed: int | None = None,
                  gone_before: float | None = None) -> None:
        """An engine snapshot as the daemon published it, with every worker's count in flight
        there then (`routed`) and the daemon's eviction verdict (`gone_before`): both beside the
        snapshot in the message, so a worker of an older release, adopted by live restore, reads
        a snapshot of the fields it knows."""
        view = self._views.get(iid)
        if view is not None:
            view.update(EngineSnapshot(**snapshot, routed=routed, gone_before=gone_before))

    def set_connected(self, up: bool) -> None:
        self.daemon_connected = up
        self._streaks.clear()

    # --- from the proxies ------------------------------------------------------------------
    def report(self, iid: str, ok: bool, reason: str) -> None:
        if self.daemon_connected:
            self._send({"t": "health", "iid": iid, "ok": ok, "reason": reason})
            return
        if ok:
            self._streaks.pop(iid, None)
            return
        n = self._streaks.get(iid, 0) + 1
        self._streaks[iid] = n
        if n >= self.threshold:
            self._streaks.pop(iid, None)
            self._table.eject(instance_index(iid), self._clock() + AWAY_EJECT_S)
            self.refresh()

    def take_served(self) -> list[str]:
        """Instances that answered since the last call (sent with the worker's stats: the
        daemon's canary runs early only on an idle instance, as in one process)."""
        out = []
        for iid, health in self._health.items():
            if health.served:
                health.served = False
                out.append(iid)
        return out

    # --- the set the proxies see ------------------------------------------------------------
    def refresh(self) -> None:
        """Publish the daemon's set less what is ejected in the table (only while it is away)."""
        if self.daemon_connected:
            self.backends.publish(self._published)
            return
        now = self._clock()
        keep = []
        for b in self._published:
            if self._table.ejected_until(instance_index(b.instance_id)) > now:
                self.ejected_away.add(b.instance_id)
            else:
                keep.append(b)
        self.backends.publish(tuple(keep))
