"""Active health checks a worker runs only while no daemon is there.

Passive health sees an instance that refuses or drops connections. It does not see one
that accepts and then says nothing (its tritonserver stopped or hung, its node gone): a
request sent there waits for --idle-timeout-s, counts as no failure meanwhile, and new
requests keep landing there (measured with the daemon away: 2 requests served in 12 s
instead of ~90, tests/test_e2e_live_restore.py). With a daemon, its own probes find such an
instance and the feed aborts what waits on it; while it is away, every worker probes the
instances it serves, with the daemon's own probe (health/probes.py: live, ready, the model
ready) and its settings (--probe-interval-s, --probe-timeout-s, --probe-failures), and
after that many failures in a row takes the instance out of rotation for every worker
(the shared table) and fails what waits on it over to the others, as the daemon would.
An instance taken out is probed on; the first answer puts it back. When the daemon comes
back it publishes the truth and this stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from orchestrator.config import Settings
from orchestrator.dataplane.membership import WorkerMembership
from orchestrator.dataplane.shared_table import SharedTable, instance_index
from orchestrator.health.probes import probe_instance
from orchestrator.routing.backends import Backend

# Aborts what waits on an instance taken out: (host, port, reason).
Abort = Callable[[str, int, str], None]


class AwayProber:
    def __init__(self, membership: WorkerMembership, table: SharedTable, abort: Abort,
                 log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._membership = membership
        self._table = table
        self._abort = abort
        self._log = log
        self._clock = clock
        self._streaks: dict[str, int] = {}
        self._out: set[str] = set()  # taken out by this prober

    async def run(self, settings: Settings) -> None:
        """Probe until cancelled (the worker cancels it when a daemon connects) or until a
        daemon is connected: a cancel can be lost (orchestrator/tasks.py), and a prober left
        running beside a daemon would eject instances the daemon says are fine."""
        self._streaks.clear()
        self._out.clear()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            while not self._membership.daemon_connected:
                started = self._clock()
                instances = self._membership.published()
                results = await asyncio.gather(*(
                    probe_instance(session, f"http://{b.host}:{b.http_port}", settings.served_model,
                                   settings.probe_timeout_s) for b in instances))
                if self._membership.daemon_connected:
                    return  # back while we probed: the daemon decides
                for b, result in zip(instances, results):
                    self.judge(b, result.ok, result.reason, settings)
                await asyncio.sleep(max(0.0, settings.probe_interval_s - (self._clock() - started)))

    def judge(self, b: Backend, ok: bool, reason: str, settings: Settings) -> None:
        iid = b.instance_id
        index = instance_index(iid)
        if ok:
            self._streaks.pop(iid, None)
            if iid in self._out:
                self._out.discard(iid)
                self._table.eject(index, 0.0)
                self._log.warning("instance %s answers its probe again: back in rotation (no daemon)", iid)
                self._membership.refresh()
            return
        n = self._streaks.get(iid, 0) + 1
        self._streaks[iid] = n
        if n < settings.probe_failures:
            return
        # Out until a probe answers: renewed on every failed probe, so a prober that dies
        # (its worker replaced) does not keep the instance out for good.
        self._table.eject(index, self._clock() + 3 * settings.probe_interval_s + settings.probe_timeout_s)
        if iid not in self._out:
            self._out.add(iid)
            self._log.warning("instance %s failed %d probes in a row with no daemon (%s): out of rotation, "
                              "what waits on it goes to the others", iid, n, reason)
            self._membership.refresh()
            self._abort(b.host, b.http_port, f"{n} failed probes: {reason}")


__all__ = ["AwayProber"]
