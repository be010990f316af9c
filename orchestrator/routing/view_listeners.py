"""How a routing policy hears every snapshot of the engines it routes to, off the request path.

An EngineView calls its listeners with each new snapshot (a scrape, ~10 a second per
instance). A policy that learns from the engine's counters (cost_policy's rates,
llm_policies' eviction verdict) listens there rather than pulling each view on every
decision: one call per scrape instead of one per candidate per request. Pure logic.

The listener holds its policy weakly: a reload replaces the policy while the views live on,
and the next policy to subscribe drops the listeners whose policy is gone.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from orchestrator.health.engine_state import EngineSnapshot, EngineView


class Observer(Protocol):
    def observe(self, iid: str, snap: EngineSnapshot) -> None:
        """Every snapshot of instance `iid`'s engine, in order."""


class Listener:
    """An EngineView listener that does not keep its observer alive."""

    __slots__ = ("_observer", "_iid", "__weakref__")

    def __init__(self, observer: Observer, iid: str) -> None:
        self._observer = weakref.ref(observer)
        self._iid = iid

    def __call__(self, snap: EngineSnapshot) -> None:
        observer = self._observer()
        if observer is not None:
            observer.observe(self._iid, snap)

    @property
    def orphaned(self) -> bool:
        return self._observer() is None


def subscribe(observer: Observer, iid: str, view: EngineView) -> None:
    """`observer.observe(iid, snap)` with the view's latest snapshot now and every one after."""
    listeners = view.listeners
    listeners[:] = [x for x in listeners if not (isinstance(x, Listener) and x.orphaned)]
    listeners.append(Listener(observer, iid))
    if view.latest is not None:
        observer.observe(iid, view.latest)
