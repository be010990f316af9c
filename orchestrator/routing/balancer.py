"""Routing: which ready instance gets the next attempt. Pure logic, shared by the
embedded HTTP proxy and the gRPC proxy.

The daemon owns readiness (`ReadyBackends`); this module only chooses among
the instances it is handed. `Balancer` keeps the proxy-local state every policy
shares, and a `Policy` only chooses:

- in-flight counts per instance, for least-outstanding and for `status`;
- a short cool-down after a connect failure. Until the daemon's health checks
  remove a dead instance (seconds), every request would otherwise try it first
  (a refused connection leaves its in-flight count at zero, so least-outstanding
  would love it). A cooling instance is still used when nothing else is left:
  the cool-down deprioritises, it never ejects; ejecting is the daemon's call.

A policy is a class with `choose` in POLICIES, and its name in config.LB_POLICIES (the
flag's choices). What it knows about the request travels as `hints` (llm_policies.RouteHints),
built by the proxy only for a policy that says `wants_prompt`. The engine-aware policies
(`kv-aware`, `prefix-affinity`) live in llm_policies.py.
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from orchestrator.routing.backends import Backend
from orchestrator.routing.cost_policy import CostModel
from orchestrator.routing.llm_policies import KvAware, PrefixAffinity, RouteHints
from orchestrator.routing.prefix_index import DEFAULT_CHUNK_CHARS

LEAST_OUTSTANDING = "least-outstanding"
ROUND_ROBIN = "round-robin"
DEFAULT_COOLDOWN_S = 1.0


class SharedCounts(Protocol):
    """A data-plane worker's own row of the shared in-flight table (dataplane/shared_table.py)."""

    def acquire(self, instance_id: str) -> None: ...

    def release(self, instance_id: str) -> None: ...


class GlobalCounts(Protocol):
    """The in-flight counts of every worker (dataplane/shared_table.GlobalInflight)."""

    def get(self, instance_id: str, default: int = 0) -> int: ...

    def of(self, backends: Sequence[Backend]) -> dict[str, int]: ...


class SharedRouting(NamedTuple):
    """What every data-plane worker routes on alike (dataplane/shared_table.py, shared_prefix.py):
    the in-flight counts of all workers, this worker's own row, and the prefix index."""

    inflight: "GlobalCounts | Mapping[str, int]"
    counts: SharedCounts
    prefix_index: Any = None  # routing.prefix_index.PrefixIndex's methods; None: the policy's own
    journal: Any = None  # routing.journal.Journal's methods (cost-model); None: the policy's own
    turns: Any = None  # routing.llm_policies.SharedTurns (the default's ties); None: the policy's own


class Policy(Protocol):
    def choose(self, backends: Sequence[Backend], skip: Collection[str],
               inflight: Mapping[str, int], hints: RouteHints | None = None) -> Backend | None:
        """One of `backends` whose instance_id is not in `skip`, or None if there is none.

        `backends` is the whole ready set in a stable order (by instance id), so a
        policy may keep positions in it across calls.
        """


class LeastOutstanding:
    """Fewest requests in flight; ties broken at random so equal instances share load."""

    __slots__ = ("_rng",)

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, backends: Sequence[Backend], skip: Collection[str],
               inflight: Mapping[str, int], hints: RouteHints | None = None) -> Backend | None:
        best: list[Backend] = []
        best_n = -1
        for b in backends:
            iid = b.instance_id
            if iid in skip:
                continue
            n = inflight.get(iid, 0)
            if best_n < 0 or n < best_n:
                best = [b]
                best_n = n
            elif n == best_n:
                best.append(b)
        if not best:
            return None
        return best[0] if len(best) == 1 else self._rng.choice(best)


class RoundRobin:
    """Each instance in turn, ignoring load; skipped ones keep their place in the rotation."""

    __slots__ = ("_next",)

    def __init__(self, rng: random.Random) -> None:
        self._next = 0

    def choose(self, backends: Sequence[Backend], skip: Collection[str],
               inflight: Mapping[str, int], hints: RouteHints | None = None) -> Backend | None:
        n = len(backends)
        start = self._next
        for i in range(n):
            b = backends[(start + i) % n]
            if b.instance_id not in skip:
                self._next = (start + i + 1) % n
                return b
        return None


POLICIES: dict[str, Callable[[random.Random], Policy]] = {
    LEAST_OUTSTANDING: LeastOutstanding,
    ROUND_ROBIN: RoundRobin,
    "kv-aware": KvAware,
    "prefix-affinity": PrefixAffinity,
    "cost-model": CostModel,
}


def notes_counts(policy: str) -> bool:
    """Whether `policy`'s choices write the counts they read to the workers' turns file
    (dataplane/shared_stamps.py), which the daemon sends with each snapshot (`routed`). Under any
    other policy that row holds what the last such choice read, however long ago."""
    return getattr(POLICIES.get(policy), "NOTES_COUNTS", False)


class Balancer:
    __slots__ = ("policy", "inflight", "_policy", "_choose", "_rng", "_clock", "_cooldown_s", "_cooling",
                 "_view", "_counts_of", "_shared", "_prefix_index", "_journal", "_turns", "_prompt_from")

    def __init__(self, policy: str = LEAST_OUTSTANDING, *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cooldown_s: float = DEFAULT_COOLDOWN_S,
                 shared: "SharedRouting | tuple[Mapping[str, int], SharedCounts] | None" = None) -> None:
        # This process's own requests in flight (its `status` share), and what the policies
        # route on: the same dict in one process, or with several data-plane workers the
        # count over all of them (`shared`: a view of the shared table and this worker's
        # row in it), so every worker balances on the same global numbers.
        self.inflight: dict[str, int] = {}
        self._view: Mapping[str, int] | GlobalCounts = shared[0] if shared is not None else self.inflight
        self._shared: SharedCounts | None = shared[1] if shared is not None else None
        self._counts_of: Callable[[Sequence[Backend]], dict[str, int]] | None = getattr(self._view, "of", None)
        self._prefix_index = shared[2] if shared is not None and len(shared) > 2 else None
        self._journal = shared[3] if shared is not None and len(shared) > 3 else None
        self._turns = shared[4] if shared is not None and len(shared) > 4 else None
        self._rng = rng or random.Random()
        self._clock = clock
        self._cooldown_s = cooldown_s
        self._cooling: dict[str, float] = {}  # instance_id -> monotonic time the cool-down ends
        self.set_policy(policy)

    def set_policy(self, policy: str) -> None:
        """Choose by `policy` from now on (a reload); in-flight counts and cool-downs stay."""
        if policy not in POLICIES:
            raise ValueError(f"lb_policy={policy!r}: must be one of {', '.join(POLICIES)}")
        self.policy = policy
        cls = POLICIES[policy]
        extra = {}
        if self._prefix_index is not None and "index" in inspect.signature(cls).parameters:
            extra["index"] = self._prefix_index  # one index for every worker: they route a prefix alike
        if self._journal is not None and "journal" in inspect.signature(cls).parameters:
            extra["journal"] = self._journal
        if self._turns is not None and "turns" in inspect.signature(cls).parameters:
            extra["turns"] = self._turns
        self._policy = cls(self._rng, **extra)
        self._choose = self._policy.choose
        # wants_prompt_of's threshold, worked out once per policy: it is asked per request.
        # prefix-affinity reads only a prompt's full chunks (RouteHints.prompt_keys): a shorter one
        # routes as no prompt, so parsing it (2-3 us a request) buys nothing; a prompt has at most
        # as many characters as the bytes that carry it (JSON and UTF-8 never fewer bytes).
        self._prompt_from: int | None = DEFAULT_CHUNK_CHARS if isinstance(self._policy, PrefixAffinity) \
            else (0 if getattr(self._policy, "wants_prompt", False) else None)

    @property
    def wants_prompt(self) -> bool:
        """Whether `pick` can use a request's prompt at all."""
        return self._prompt_from is not None

    def wants_prompt_of(self, size: int) -> bool:
        """Whether `pick` can use the prompt of a request whose body (or gRPC message, or the
        prompt itself) is `size` bytes or characters: worth parsing it for (set_policy says when)."""
        least = self._prompt_from
        return least is not None and size >= least

    @property
    def last_reason(self) -> str:
        """Why the last pick went where it did (for the routing-decision metrics)."""
        return getattr(self._policy, "last_reason", "") or self.policy

    @property
    def last_decision(self) -> Any:
        """The last pick's estimate (cost_policy.Decision; None for other policies): the proxy
        hands it to ProxyMetrics.route_decision, whose TTFT timer reports the first token to it."""
        return getattr(self._policy, "last_decision", None)

    # --- choice ----------------------------------------------------------------
    def pick(self, backends: Sequence[Backend], exclude: Collection[str] = (),
             hints: RouteHints | None = None) -> Backend | None:
        """The instance for the next attempt, or None when every candidate is excluded."""
        if not backends:
            return None
        cooling = self._cooling
        if cooling:
            now = self._clock()
            for iid, until in list(cooling.items()):
                if until <= now:
                    del cooling[iid]
        # With several workers, each count is a sum over the workers' rows of the shared table:
        # read once per pick, together, rather than per instance each time a policy looks.
        of = self._counts_of
        # (without `of` the view is the worker's own counts, a Mapping)
        view: Mapping[str, int] = self._view if of is None else of(backends)  # type: ignore[assignment]
        if not cooling:
            return self._choose(backends, exclude, view, hints)
        # Cooling instances only when nothing else is left.
        chosen = self._choose(backends, cooling.keys() | set(exclude), view, hints)
        if chosen is None:
            chosen = self._choose(backends, exclude, view, hints)
        return chosen

    def forget(self, instance_id: str) -> None:
        """The instance left the ready set (it restarts): what a policy learnt of it is void."""
        forget = getattr(self._policy, "forget", None)
        if forget is not None:
            forget(instance_id)

    # --- bookkeeping -------------------------------------------------------------
    def acquire(self, instance_id: str) -> None:
        self.inflight[instance_id] = self.inflight.get(instance_id, 0) + 1
        if self._shared is not None:
            self._shared.acquire(instance_id)

    def release(self, instance_id: str) -> None:
        n = self.inflight.get(instance_id, 0) - 1
        if n > 0:
            self.inflight[instance_id] = n
        else:
            self.inflight.pop(instance_id, None)
        if self._shared is not None:
            self._shared.release(instance_id)

    def connect_failed(self, instance_id: str) -> None:
        self._cooling[instance_id] = self._clock() + self._cooldown_s

    def succeeded(self, instance_id: str) -> None:
        if self._cooling:
            self._cooling.pop(instance_id, None)

    def is_cooling(self, instance_id: str) -> bool:
        until = self._cooling.get(instance_id)
        return until is not None and until > self._clock()

    def snapshot(self) -> dict[str, int]:
        return dict(self.inflight)
