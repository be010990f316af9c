"""The Python half of a request the compiled front serves: the embedded path's rules, per request.

_front.c reads the request, relays the bytes and keeps the deadlines; it asks this module at each
turn of the request's life, on the worker's loop thread (the front runs inside the loop's poll):

    decide(head, body)              -> (slot, request[, True]) | None: hand the connection to aiohttp
    retry(request, reason)          -> (slot, request) | bytes: the answer to send instead | False:
                                    hand it to aiohttp (no other instance to try: it holds)
    answered(request, status, body) -> (slot, request) | bytes | False | None: relay the error answer
    first(request)                  the first SSE event reached the client, where decide asked (True:
                                    a routing model learns its prefill is done then, not at the end)
    release(request, status, outcome, events, head_at, first_at, itl)   once, when the request is
                                    over: the time to first token, the instance's latency and the
                                    inter-token times (counted per bucket) from the front's own
                                    clock (time.monotonic's), taken as they happened

What is only counted (metrics, the worker's tally) is done after the bytes, not on their way:
FrontPath notes it in a batch (ledger.py), and `account` folds the batch ACCOUNT_AFTER_S after a
poll that noted some (a timer armed as the poll returns), at each sweep, and before the metrics
are read. Idle, the
interpreter runs a request's Python several times slower than in a busy loop (on the 2-core box:
decide 230 us, release 180 us, against about 20 us each when busy); at one stream that was most
of what the front added to the first token (+1.2-1.5 ms, NGINX +0.3 ms). Run as the poll returned,
the queue was still in the way: the instance's first event comes back tens of microseconds after
the request went out, the client's next request as soon after the last answer.
What routing depends on (the balancer's counts, passive health, a routing model's pick) is done
at once, as before.

The rules are EmbeddedProxy's, not copies: the surface's classification (a route that is not a
public native generation, or admin, goes to aiohttp, which answers it as always), the hold (no
instance ready: aiohttp holds it), the balancer's pick, acquire and release, the refusals retried
elsewhere (`_refusal`), a failed attempt's accounting (`_attempt_failed`), passive health
(`_settle`, `_upstream_failed`) and the metrics. One difference: the front checks an attempt's
--first-byte-timeout-s at its sweeps (compiled.SWEEP_S), so it retries it elsewhere up to 0.1 s
after the deadline, where the embedded path's wait_for fires on time.

State: each request's `_FrontRequest`, owned by the front (it holds it from decide to release);
the batch of counts not folded yet (a Ledger), owned by FrontPath (spent by `account`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from orchestrator.dataplane.embedded import error_json
from orchestrator.dataplane.front.ledger import Ledger
from orchestrator.dataplane.metrics import NO_INSTANCE
from orchestrator.routing.backends import Backend
from orchestrator.routing.llm_policies import RouteHints
from orchestrator.routing.prompt import prompt_of_json
from orchestrator.routing.surface import PUBLIC

if TYPE_CHECKING:
    from orchestrator.dataplane.embedded import EmbeddedProxy  # noqa: F401 (the annotation's)

# release()'s outcome (_front.c's enum outcome); HANDED: the request went to aiohttp, which answers it
DONE, CLIENT_GONE, CUT, IDLE, FAILED, HANDED = range(6)
HAND_OFF = False  # retry()'s and answered()'s word for it
_LLM_ACTIONS = frozenset({"generate", "generate_stream", "infer"})
# The reasons for which a failed attempt does not count against the instance (the embedded path's
# _Retryable(blame=False)): it said it was busy, or it had left rotation.
_NOT_BLAMED = ("http_", "queue_full")
# After the first event of a request sent now, after the next request of a client that answers at
# once (tens of us busy, a few hundred idle); soon enough for `status` and `top` (a read of /metrics
# folds this worker's first; the other workers' counts it adds up are as they last folded them). A
# fold costs per instance and value more than per request: in process on the 2-core box 10.7 us a
# request in batches of 10 (1 ms at a worker's 10k requests/s), 3.4 in 30, 1.7 in 100.
ACCOUNT_AFTER_S = 0.01
_TARGETS_MAX = 4096


def error_answer(status: int, message: str, extra: str = "") -> bytes:
    """The whole answer the embedded path's `_error` gives, as bytes for the front to send."""
    data = error_json(message).encode()
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(data)}\r\n{extra}\r\n").encode() + data


class _FrontRequest:
    __slots__ = ("timer", "hints", "path", "tried", "backend", "sent_at", "last", "first_seen")

    def __init__(self, timer: Any, hints: RouteHints | None, path: str) -> None:
        self.timer = timer
        self.hints = hints
        self.path = path
        self.tried: list[str] = []
        self.backend: Backend | None = None  # the attempt in flight's instance
        self.sent_at = 0.0
        self.last = "no attempt made"
        self.first_seen = False  # first() ran: the first event is counted already


class FrontPath:
    """decide/retry/answered/first/release for one worker's front, over its EmbeddedProxy."""

    def __init__(self, proxy: EmbeddedProxy, slot_of: Any, log: logging.Logger) -> None:
        self._proxy = proxy
        self._slot_of = slot_of  # _front.instance(host, port)
        self._slots: dict[tuple[str, int], int] = {}
        self._targets: dict[bytes, tuple[str, str] | None] = {}  # request line -> `_target`'s answer
        self._log = log
        self._ledger = Ledger()
        self._account_at: asyncio.TimerHandle | None = None
        proxy.metrics.unsettled.append(self.account)  # a read of the metrics counts what is noted

    def after_poll(self) -> None:
        """The front's poll returned: count what it noted a little later (the module's doc)."""
        if self._account_at is None and self._ledger:
            self._account_at = asyncio.get_running_loop().call_later(ACCOUNT_AFTER_S, self.account)

    def account(self) -> None:
        """Fold what is noted into the metrics now (its timer, a sweep, a read of the metrics, the
        front's stop)."""
        if self._account_at is not None:
            self._account_at.cancel()
            self._account_at = None
        ledger = self._ledger
        if not ledger:
            return
        self._ledger = Ledger()
        try:
            ledger.fold(self._proxy.metrics, self._proxy._tally, time.monotonic())
        except Exception:  # a bug in counting must not stop the front
            self._log.exception("front: counting a batch of requests failed")

    def slot_known(self, host: str, port: int) -> int:
        """The slot of an instance this front has sent to (-1: none)."""
        return self._slots.get((host, port), -1)

    def _slot(self, b: Backend) -> int:
        key = (b.host, b.http_port)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = self._slot_of(b.host, b.http_port)
        return slot

    def _target(self, line: bytes) -> tuple[str, str] | None:
        """The request line's (path, action) where the front may send it; None: aiohttp's.
        Worked out once per distinct line (a few model routes; bounded as Surface's cache)."""
        # the front took only "POST <target> HTTP/1.1", CRLF or bare LF
        target = line.split(b" ")[1].decode("latin-1")
        raw_path = target.partition("?")[0]
        route = self._proxy._surface.route("POST", raw_path)
        # Everything but a public native generation is aiohttp's to answer (admin: 403 or forwarded
        # with --allow-admin; /v1); so is a path normalised or with a query (sent as classified).
        found = None
        if route.kind is PUBLIC and route.api == "v2" and route.path == raw_path and "?" not in target:
            found = (raw_path, raw_path.rpartition("/")[2])
        if len(self._targets) >= _TARGETS_MAX:
            self._targets.clear()  # a scan of paths cannot grow memory
        self._targets[line] = found
        return found

    def decide(self, head: bytes, body: bytes) -> tuple[int, _FrontRequest] | tuple[int, _FrontRequest, bool] | None:
        p = self._proxy
        line = head[:head.index(b"\n")]
        found = self._targets.get(line, False)
        if found is False:
            found = self._target(line)
        # the --proxy none side workers' requests (/v1/ alone) are aiohttp's; so is a request to hold
        if found is None or p._openai_only or p._stopping:
            return None
        backends = p._backends.current()
        if not backends:
            return None
        raw_path, action = found  # type: ignore[misc]  # not False: worked out above
        timer = p.metrics.timer(action) if action in _LLM_ACTIONS else None
        hints = RouteHints.from_prompt(prompt_of_json(body)) if p._balancer.wants_prompt_of(len(body)) else None
        request = _FrontRequest(timer, hints, raw_path)
        chosen = self._attempt(request, backends)
        if chosen is None:  # no instance this front can reach (a host name, not an address)
            self._attempt_over(request)
            return None
        if timer is not None and timer.decision is not None:
            return chosen[0], request, True  # the routing model's pick: first() at the first token
        return chosen

    def _attempt(self, request: _FrontRequest, backends: tuple[Backend, ...]) -> tuple[int, _FrontRequest] | None:
        p = self._proxy
        balancer = p._balancer
        b = balancer.pick(backends, request.tried, request.hints)
        if b is None:
            return None
        slot = self._slot(b)
        if slot < 0:
            return None
        iid = b.instance_id
        request.tried.append(iid)
        self._ledger.pick(balancer.policy, balancer.last_reason, iid)
        if request.timer is not None:
            p.metrics.route_decision(balancer.last_decision, request.timer)
        balancer.acquire(iid)
        request.backend = b
        request.sent_at = time.monotonic()
        return slot, request

    def _attempt_over(self, request: _FrontRequest) -> None:
        b = request.backend
        if b is not None:
            request.backend = None
            self._proxy._balancer.release(b.instance_id)
            self._ledger.attempt_over(b.instance_id)
        if request.timer is not None:
            request.timer.attempt_over()

    def retry(self, request: _FrontRequest, reason: str) -> tuple[int, _FrontRequest] | bytes | bool:
        p = self._proxy
        b = request.backend
        assert b is not None
        iid = b.instance_id
        self._attempt_over(request)
        if reason == "header_timeout":
            # The instance took the request and went silent for --idle-timeout-s: not retried (the
            # work may be running), reported as a hang.
            p._upstream_failed(b, "header_timeout")
            p.metrics.count(iid, 504)
            return error_answer(504, "instance did not answer within the idle timeout")
        if reason == "bad_response":
            p._upstream_failed(b, "bad_response")
            p.metrics.count(iid, 502)
            return error_answer(502, "instance sent an invalid response")
        if reason == "aborted":  # the daemon took it out of rotation: retried as a dropped connection
            reason = "disconnected"
        request.last = f"instance {iid}: {reason}"
        more = len(request.tried) < p._max_attempts
        p._attempt_failed(b, reason, not reason.startswith(_NOT_BLAMED), more)
        backends = p._backends.current()
        chosen = self._attempt(request, backends) if more and backends else None
        if chosen is not None:
            return chosen
        if more:
            # Only instances already tried are left, or none is ready (an instance that just died,
            # not yet out of rotation, or restarting): the embedded path pauses, picks again and
            # holds while none is ready. It carries the request from here, nothing of it having
            # reached the client.
            return HAND_OFF
        p.metrics.count(NO_INSTANCE, 502)
        self._log.warning("POST %s: all %d attempt(s) failed, last: %s", request.path, len(request.tried),
                          request.last)
        return error_answer(502, f"all upstream attempts failed ({request.last})")

    def answered(self, request: _FrontRequest, status: int,
                 body: bytes) -> tuple[int, _FrontRequest] | bytes | bool | None:
        b = request.backend
        assert b is not None
        refusal = self._proxy._refusal(status, b.instance_id, body)
        if refusal is None:
            return None  # the client's answer: relayed, its latency and count at release
        self._proxy.metrics.observe_latency(b.instance_id, time.monotonic() - request.sent_at)
        return self.retry(request, refusal)

    def first(self, request: _FrontRequest) -> None:
        b = request.backend
        if request.timer is not None and b is not None:
            request.first_seen = True
            request.timer.events(b.instance_id)

    def release(self, request: _FrontRequest, status: int, outcome: int, events: int, head_at: float,
                first_at: float, itl: tuple[float, tuple[int, ...]] | None = None) -> None:
        p = self._proxy
        b = request.backend
        ledger = self._ledger
        try:
            if b is None or outcome == HANDED:  # our own answer went (retry gave up), or aiohttp's will
                return
            if outcome == FAILED:
                ledger.answer(NO_INSTANCE, status, None)
                return
            iid = b.instance_id
            if head_at:  # the instance answered (its head): passive health at once, as the embedded path's
                p._settle(b, status)
                ledger.answer(iid, status, head_at - request.sent_at)
            timer = request.timer
            if timer is not None and status < 300 and head_at:
                first = None
                if not request.first_seen:  # first() counted it where a routing model asked
                    # its time: when the first event reached the client; a non-streamed answer's one
                    # event, the answer (its end: now)
                    at = first_at or (time.monotonic() if events == 0 and outcome == DONE else 0.0)
                    if at:
                        first = (at - timer.started, at)
                        # A routing model waiting for this first token learns of it now, before the
                        # attempt's end below tells it the prefill went nowhere.
                        timer.first_token(*first)
                later = events - 1 if events > 1 else 0
                ledger.tokens(iid, timer.api, first, later + (first is not None), itl if later else None)
            if outcome == CUT or outcome == IDLE:
                # Committed: bytes reached the client, which sees the cut (the connection closed).
                reason = "idle_timeout" if outcome == IDLE else "body_error"
                p._upstream_failed(b, reason)
                self._log.warning("instance %s: response cut mid-stream (%s)", iid, reason)
        finally:
            self._attempt_over(request)
            if outcome != HANDED:  # aiohttp's handler tallies a handed one
                ledger.tallied += 1
