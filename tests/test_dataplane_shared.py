"""What data-plane workers share: the in-flight table, the prefix index, the feed, membership.

Two objects opened on the same file stand for two worker processes (the mmap is the
same pages either way); the process-level proof is tests/test_e2e_workers.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from orchestrator.config import Settings, settings_from_json, settings_to_json
from orchestrator.dataplane.feed import FeedClient, FeedServer
from orchestrator.dataplane.membership import AWAY_EJECT_S, WorkerMembership
from orchestrator.dataplane.shared_stamps import SharedStamps
from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
from orchestrator.dataplane.shared_table import (GlobalInflight, SharedTable, TableError, WorkerCounts,
                                                 instance_index)
from orchestrator.errors import UsageError
from orchestrator.routing.backends import Backend, ReadyBackends
from orchestrator.routing.balancer import Balancer, SharedRouting
from orchestrator.routing.llm_policies import RouteHints, SharedTurns
from orchestrator.routing.prefix_index import DEFAULT_CHUNK_CHARS, chunk_keys, recorded

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def backends(n: int) -> tuple[Backend, ...]:
    return tuple(Backend(str(i), "127.0.0.1", 9000 + i, 9100 + i, 9200 + i) for i in range(n))


# --- the in-flight table -----------------------------------------------------------------
def test_inflight_is_the_sum_of_every_workers_row(tmp_path):
    a = SharedTable.create(tmp_path / "t")
    b = SharedTable.open(tmp_path / "t")
    WorkerCounts(a, 0).acquire("3")
    WorkerCounts(b, 5).acquire("3")
    WorkerCounts(b, 5).acquire("1")
    assert GlobalInflight(a)["3"] == 2 and GlobalInflight(b).get("1") == 1
    assert a.worker_inflight(5) == 2
    a.clear_worker(5)  # worker 5 died: its requests died with its connections
    assert GlobalInflight(b)["3"] == 1 and GlobalInflight(b).get("1") == 0


def test_a_workers_counts_land_in_its_own_row_and_leave_the_table_closable(tmp_path):
    """WorkerCounts keeps each instance's cell once met: the same cells add_inflight wrote, an id
    beyond the table refused every time (not remembered as a cell), and no view of the map kept
    open past the table's close."""
    table = SharedTable.create(tmp_path / "t")
    mine, other = WorkerCounts(table, 3), WorkerCounts(table, 4)
    for _ in range(3):
        mine.acquire("255")
        mine.acquire("0")
    other.acquire("0")
    mine.release("0")
    assert table.worker_inflight(3) == 5 and table.worker_inflight(4) == 1
    assert GlobalInflight(table)["0"] == 3 and GlobalInflight(table)["255"] == 3
    table.add_inflight(3, 255, -3)
    assert GlobalInflight(table)["255"] == 0  # one cell, whoever writes it
    for _ in range(2):
        with pytest.raises(TableError, match="'256'"):
            mine.acquire("256")
    assert table.worker_inflight(3) == 2
    table.close()  # BufferError if a view of the map were still exported


def test_table_of_another_layout_is_refused(tmp_path):
    (tmp_path / "t").write_bytes(b"x" * 100)
    with pytest.raises(TableError, match="size 100"):
        SharedTable.open(tmp_path / "t")
    with pytest.raises(TableError, match="cannot open"):
        SharedTable.open(tmp_path / "missing")


def test_instance_index_bounds():
    assert instance_index("0") == 0 and instance_index("255") == 255
    with pytest.raises(TableError, match="'256'"):
        instance_index("256")


def test_balancers_of_two_workers_route_on_the_global_count(tmp_path):
    table = SharedTable.create(tmp_path / "t")
    bs = backends(2)
    w0 = Balancer("least-outstanding", shared=SharedRouting(GlobalInflight(table), WorkerCounts(table, 0)))
    w1 = Balancer("least-outstanding", shared=SharedRouting(GlobalInflight(table), WorkerCounts(table, 1)))
    first = w0.pick(bs)
    w0.acquire(first.instance_id)
    # worker 1 has nothing in flight itself, but sees worker 0's request: the other instance
    for _ in range(20):
        assert w1.pick(bs).instance_id != first.instance_id
    w0.release(first.instance_id)
    assert GlobalInflight(table).get(first.instance_id) == 0
    assert w0.snapshot() == {}  # its own share, for status


@pytest.mark.parametrize("shared_turns", [True, False])
def test_workers_take_ties_in_turn_together(tmp_path, shared_turns):
    # Every request ends before the next comes, so the instances are always tied; each arrives at
    # either worker at random. With the turns shared they alternate as one policy's would (and as
    # NGINX's least_conn does); with a worker's own turns, a worker's first pick of each tie
    # repeats where the other just went.
    table = SharedTable.create(tmp_path / "t")
    table.use_rows(2)
    stamps = SharedStamps.create(tmp_path / "turns")
    bs = backends(2)
    clock = iter(range(1, 10**6)).__next__
    workers = [Balancer("prefix-affinity", clock=clock, shared=SharedRouting(
        GlobalInflight(table), WorkerCounts(table, k), None, None,
        SharedTurns(stamps) if shared_turns else None)) for k in (0, 1)]
    rng = random.Random(3)
    picks = []
    for _ in range(40):
        w = rng.choice(workers)
        iid = w.pick(bs).instance_id
        w.acquire(iid)
        w.release(iid)
        picks.append(iid)
    repeats = sum(a == b for a, b in zip(picks, picks[1:]))
    if shared_turns:
        assert repeats == 0, picks
        # and each choice left the counts it read (its own pick's added) for the daemon
        assert stamps.count(picks[-1]) == 1 and stamps.count(next(i for i in ("0", "1") if i != picks[-1])) == 0
    else:
        assert repeats > 5, (repeats, picks)  # what the shared turns are for (7 of 39 with this seed)


def test_inflight_sums_the_rows_the_daemon_has_put_in_use(tmp_path):
    table = SharedTable.create(tmp_path / "t")
    WorkerCounts(table, 0).acquire("2")
    WorkerCounts(table, 9).acquire("2")
    assert GlobalInflight(table)["2"] == 2  # a table of an older daemon (no rows mark): every row counts
    table.use_rows(3)  # the daemon started workers in slots 0..2
    WorkerCounts(table, 2).acquire("2")
    assert GlobalInflight(table)["2"] == 2  # slot 9 is beyond the rows in use (never written in practice)
    table.use_rows(1)  # never lowered: a slot once started may still count
    assert GlobalInflight(table)["2"] == 2
    table.use_rows(10)
    assert GlobalInflight(table)["2"] == 3


def test_a_ready_sets_counts_are_read_together(tmp_path):
    table = SharedTable.create(tmp_path / "t")
    table.use_rows(4)
    view = GlobalInflight(table)
    for worker, iid in ((0, "1"), (3, "1"), (2, "3"), (1, "4")):
        WorkerCounts(table, worker).acquire(iid)
    ready = backends(5)[1:]
    assert view.of(ready) == {"1": 2, "2": 0, "3": 1, "4": 1}
    WorkerCounts(table, 1).release("4")
    assert view.of(ready) == {"1": 2, "2": 0, "3": 1, "4": 0}  # read again, not kept
    assert view.of(backends(2)) == {"0": 0, "1": 2}  # another ready set: its own columns
    assert view.of(()) == {}
    beyond = (Backend("300", "127.0.0.1", 1, 2, 3), *backends(2))  # no column in the table: 0, as get()
    assert view.of(beyond) == {"300": 0, "0": 0, "1": 2} and view.get("300") == 0
    gaps = (*backends(5)[3:0:-2], backends(1)[0])  # out of order, a column skipped
    assert [b.instance_id for b in gaps] == ["3", "1", "0"] and view.of(gaps) == {"3": 1, "1": 2, "0": 0}
    one = SharedTable.create(tmp_path / "one")
    one.use_rows(1)  # one worker's row: read as it is
    WorkerCounts(one, 0).acquire("2")
    assert GlobalInflight(one).of(ready) == {"1": 0, "2": 1, "3": 0, "4": 0}


# --- the prefix index ----------------------------------------------------------------------
def two_workers_index(tmp_path):
    """A clock, and the shared prefix index as two workers have it open."""
    clock = Clock()
    a = SharedPrefixIndex.create(tmp_path / "p", slots=1024, clock=clock)
    return clock, a, SharedPrefixIndex.open(tmp_path / "p", clock=clock)


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode().ljust(16, b".")[:16] for i in range(n)]


def test_prefix_recorded_by_one_worker_matches_in_another(tmp_path):
    clock, a, b = two_workers_index(tmp_path)
    a.record(keys("x", 5), "2")
    b.record(keys("x", 4), "7")
    assert b.match(keys("x", 5)) == (5, {"2": 5, "7": 4})
    assert a.match(keys("y", 4)) == (4, {})
    b.forget_instance("2")  # it restarted: its cache is gone for every worker
    clock.t += 0.001
    assert a.match(keys("x", 5)) == (5, {"7": 4})
    a.record(keys("x", 2), "2")  # routed there again after the restart
    assert b.match(keys("x", 5))[1] == {"2": 2, "7": 4}


def test_prefix_recency_is_when_any_worker_last_routed_each_holders_deepest_chunk(tmp_path):
    clock, a, b = two_workers_index(tmp_path)
    a.record(keys("x", 5), "2")
    clock.t += 1
    b.record(keys("x", 4), "7")
    clock.t += 1
    b.record(keys("x", 2), "2")  # its first two chunks again, through the other worker
    assert a.match_recency(keys("x", 5)) == (5, {"2": (5, 1000.0), "7": (4, 1001.0)})
    assert a.match_recency(keys("x", 2)) == (2, {"2": (2, 1002.0), "7": (2, 1001.0)})
    assert b.match_recency(keys("y", 2)) == (2, {})


def test_prefix_entries_age_out(tmp_path):
    clock = Clock()
    idx = SharedPrefixIndex.create(tmp_path / "p", slots=64, ttl_s=10.0, clock=clock)
    idx.record(keys("x", 2), "0")
    clock.t += 11
    assert idx.match(keys("x", 2)) == (2, {})


def test_prefix_index_is_bounded_and_keeps_recent_keys(tmp_path):
    clock = Clock()
    idx = SharedPrefixIndex.create(tmp_path / "p", slots=64, clock=clock)
    for i in range(500):
        clock.t += 1
        idx.record(keys(f"k{i}", 1), "1")
    assert len(idx) <= 64
    assert idx.match(keys("k499", 1))[1] == {"1": 1}  # the newest survives eviction


def test_prefix_key_keeps_the_holders_used_last(tmp_path):
    clock = Clock()
    idx = SharedPrefixIndex.create(tmp_path / "p", slots=64, clock=clock)
    for iid in ("0", "1", "2", "3", "4", "5"):
        clock.t += 1
        idx.record(keys("s", 1), iid)
    assert set(idx.match(keys("s", 1))[1]) == {"2", "3", "4", "5"}


def test_prefix_routed_all_the_time_outlives_keys_passing_through_its_neighbourhood(tmp_path):
    """A new key takes the slot of its neighbourhood used least recently: prefixes routed all the
    time survive one-off keys ten times the table's size, in neighbourhoods inside the table and
    wrapping at its end (a key's first byte is its probe start in a 64-slot table)."""
    clock = Clock()
    idx = SharedPrefixIndex.create(tmp_path / "p", slots=64, clock=clock)
    hot = [bytes([start]) + b"hot-prefix-key!" for start in (0, 30, 60)]
    rng = random.Random(7)
    lost = 0
    for _ in range(640):
        clock.t += 1
        idx.record([rng.randbytes(16)], "1")
        for key in hot:
            lost += idx.match([key])[1] != {"2": 1}
            idx.record([key], "2")
    assert lost == 3  # each hot key once, before it was first recorded
    assert len(idx) == 64


def test_prefix_affinity_of_two_workers_agrees(tmp_path):
    table = SharedTable.create(tmp_path / "t")
    index_a = SharedPrefixIndex.create(tmp_path / "p", slots=1024)
    index_b = SharedPrefixIndex.open(tmp_path / "p")
    bs = backends(4)
    w0 = Balancer("prefix-affinity", rng=random.Random(1),
                  shared=SharedRouting(GlobalInflight(table), WorkerCounts(table, 0), index_a))
    w1 = Balancer("prefix-affinity", rng=random.Random(2),
                  shared=SharedRouting(GlobalInflight(table), WorkerCounts(table, 1), index_b))
    for tenant in range(8):
        hints = RouteHints.from_prompt(f"tenant {tenant} system prompt " * 40 + "question")
        first = w0.pick(bs, hints=hints)
        assert w1.pick(bs, hints=hints).instance_id == first.instance_id
        assert w1.last_reason == "prefix"


def test_prefix_index_of_another_layout_is_refused(tmp_path):
    (tmp_path / "p").write_bytes(bytes(4096))
    with pytest.raises(TableError, match="not a shared prefix index"):
        SharedPrefixIndex.open(tmp_path / "p")


# --- membership in a worker -------------------------------------------------------------------
def member_list(n: int) -> list[dict]:
    return [{"id": str(i), "host": "127.0.0.1", "http": 9000 + i, "grpc": 9100 + i, "metrics": 9200 + i}
            for i in range(n)]


def test_failures_go_to_the_daemon_while_it_is_there(tmp_path):
    table = SharedTable.create(tmp_path / "t")
    sent = []
    m = WorkerMembership(ReadyBackends(), table, sent.append, threshold=2)
    m.set_connected(True)
    m.on_members(member_list(2))
    b = m.backends.current()[0]
    b.health.failure("refused")
    b.health.failure("refused")
    b.health.success()
    b.health.success()  # a success after a success is not news
    assert sent == [{"t": "health", "iid": "0", "ok": False, "reason": "refused"}] * 2 + \
        [{"t": "health", "iid": "0", "ok": True, "reason": ""}]
    assert len(m.backends.current()) == 2  # the daemon decides ejections


def two_workers_away(tmp_path, clock: Clock) -> tuple[SharedTable, WorkerMembership, WorkerMembership]:
    """Two workers on one table, 3 instances, their daemon killed."""
    table = SharedTable.create(tmp_path / "t")
    w0 = WorkerMembership(ReadyBackends(), table, lambda msg: None, threshold=3, clock=clock)
    w1 = WorkerMembership(ReadyBackends(), SharedTable.open(tmp_path / "t"), lambda msg: None, threshold=3,
                          clock=clock)
    for m in (w0, w1):
        m.set_connected(True)
        m.on_members(member_list(3))
        m.set_connected(False)  # the daemon was killed
        m.refresh()
    return table, w0, w1


def test_while_the_daemon_is_away_one_worker_ejects_for_all(tmp_path):
    clock = Clock()
    _, w0, w1 = two_workers_away(tmp_path, clock)
    dead = w0.backends.current()[1]
    for _ in range(3):
        dead.health.failure("connection refused")
    assert [b.instance_id for b in w0.backends.current()] == ["0", "2"]
    w1.refresh()  # its heartbeat tick
    assert [b.instance_id for b in w1.backends.current()] == ["0", "2"]
    clock.t += AWAY_EJECT_S + 0.1  # tried again after the ejection (passive re-admission)
    w1.refresh()
    assert [b.instance_id for b in w1.backends.current()] == ["0", "1", "2"]


def test_daemon_back_publishes_the_truth(tmp_path):
    clock = Clock()
    table = SharedTable.create(tmp_path / "t")
    m = WorkerMembership(ReadyBackends(), table, lambda msg: None, threshold=1, clock=clock)
    m.on_members(member_list(2))
    m.refresh()
    m.backends.current()[0].health.failure("refused")
    assert [b.instance_id for b in m.backends.current()] == ["1"]
    m.set_connected(True)
    m.on_members(member_list(2))  # the new daemon's first message: its health checks decide
    assert [b.instance_id for b in m.backends.current()] == ["0", "1"]


def test_an_instance_that_leaves_loses_its_engine_view(tmp_path):
    m = WorkerMembership(ReadyBackends(), SharedTable.create(tmp_path / "t"), lambda msg: None, threshold=1)
    m.set_connected(True)
    m.on_members(member_list(2))
    m.on_engine("1", {"at": 1.0, "active": 3, "max_active": 8, "waiting": 0, "kv_used": 10, "kv_max": 100})
    view = m.backends.current()[1].engine
    assert view.latest is not None
    m.on_members(member_list(1))
    assert view.latest is None


def _pool_publishing_one_instance(tmp_path, settings: Settings):
    """A daemon's worker pool (no worker started) with instance "1" ready, the engine view it
    publishes, and the feed's messages as it broadcasts them."""
    from orchestrator.controlplane.workers import WorkerPool
    from orchestrator.dataplane.worker import dataplane_dir
    from orchestrator.health.engine_state import EngineView

    ready = ReadyBackends()
    pool = WorkerPool(settings, ready, tmp_path)
    dataplane_dir(tmp_path).mkdir(mode=0o700)
    pool._fresh_files()
    sent: list[dict] = []

    class Feed:  # the feed server's broadcast, recorded
        def broadcast(self, msg: dict) -> None:
            sent.append(msg)

    pool._feed = Feed()  # type: ignore[assignment]
    pool._unsubscribe = ready.subscribe(pool._on_members)
    view = EngineView()
    ready.publish((Backend("1", "127.0.0.1", 9001, 9101, 9201, engine=view),))
    return pool, view, sent


def test_the_daemon_publishes_each_snapshot_with_every_workers_count_then(tmp_path):
    from orchestrator.health.engine_state import EngineSnapshot

    pool, view, sent = _pool_publishing_one_instance(tmp_path, Settings())
    table = SharedTable.open(tmp_path / "dataplane" / "table")
    table.use_rows(3)
    WorkerCounts(table, 0).acquire("1")
    WorkerCounts(table, 2).acquire("1")
    view.update(EngineSnapshot(at=1.0, active=2, iteration=1.0))
    msg = sent[-1]
    assert msg["t"] == "engine" and msg["routed"] == 2
    # A worker's choice read 3 there (one request has ended since, after the engine's last
    # iteration, which may still count it): the count as that choice read it, as one worker's
    # own notes would say.
    stamps = SharedStamps.open(tmp_path / "dataplane" / "turns")
    stamps.note_count("1", 3)
    view.update(EngineSnapshot(at=1.1, active=3, iteration=2.0))
    assert sent[-1]["routed"] == 3
    # A worker that connects now gets that snapshot with the count it went out with, not the
    # count now (requests that began after the scrape: the snapshot's numbers do not hold them).
    for _ in range(2):
        WorkerCounts(table, 1).acquire("1")
    assert pool._routed("1") == 4
    (catch_up,) = [m for m in pool._on_connect(0, {}) if m["t"] == "engine"]
    assert catch_up["routed"] == 3
    # what a worker rebuilds from it (WorkerMembership.on_engine)
    m = WorkerMembership(ReadyBackends(), table, lambda msg: None, threshold=1)
    m.on_members(member_list(2))
    m.on_engine(msg["iid"], msg["snap"], msg["routed"])
    assert m.backends.current()[1].engine.latest.routed == 2


def test_the_daemon_sends_its_eviction_verdict_with_each_snapshot_and_to_a_worker_that_connects(tmp_path):
    import json
    import math

    from orchestrator.dataplane.feed import encode
    from orchestrator.health.engine_state import EngineSnapshot
    from orchestrator.routing.eviction import KvWrites

    pool, view, sent = _pool_publishing_one_instance(tmp_path, Settings())
    own = KvWrites()  # what a worker that saw every one of these snapshots would judge

    def snap(at: float, finished: int, prompt_tokens: int) -> EngineSnapshot:
        return EngineSnapshot(at=at, max_active=8, kv_max=200, kv_free=100, kv_used=100, tokens_per_block=64,
                              iteration=at, finished=finished, input_tokens=prompt_tokens)

    for s in (snap(1.0, 0, 0), snap(1.1, 0, 0), snap(6.0, 20, 150 * 64)):
        view.update(s)
        own.observe(s)
        if s.at == 1.0:  # nothing judged gone yet: -inf, which the feed's JSON carries as such
            assert json.loads(encode(sent[-1]))["gone_before"] == -math.inf
    assert own.gone_before == 1.1 and sent[-1]["gone_before"] == own.gone_before
    (catch_up,) = [m for m in pool._on_connect(0, {}) if m["t"] == "engine"]
    assert catch_up["gone_before"] == own.gone_before
    # what a worker rebuilds from the line the feed sends (WorkerMembership.on_engine)
    msg = json.loads(encode(catch_up))
    m = WorkerMembership(ReadyBackends(), SharedTable.open(tmp_path / "dataplane" / "table"), lambda msg: None,
                         threshold=1)
    m.on_members(member_list(2))
    m.on_engine(msg["iid"], msg["snap"], msg.get("routed"), msg.get("gone_before"))
    assert m.backends.current()[1].engine.latest.gone_before == 1.1


async def test_a_pool_started_after_its_instances_were_ready_publishes_their_engine_numbers(tmp_path, monkeypatch):
    """The ready set was published before the pool subscribed (the data-plane bench's; a daemon's
    instances become ready after): each snapshot still reaches the workers as it comes, with every
    worker's count (a worker that connects gets the latest one from the view itself)."""
    from orchestrator.controlplane.workers import WorkerPool
    from orchestrator.health.engine_state import EngineSnapshot, EngineView

    async def no_workers(count: int) -> None:  # the pool's own part, no worker processes
        pass

    ready = ReadyBackends()
    view = EngineView()
    ready.publish((Backend("1", "127.0.0.1", 9001, 9101, 9201, engine=view),))
    pool = WorkerPool(Settings(listen="127.0.0.1:0", metrics_listen="", grpc_listen=""), ready, tmp_path)
    monkeypatch.setattr(pool, "_grow", no_workers)
    await pool.start()
    try:
        sent: list[dict] = []
        monkeypatch.setattr(pool._feed, "broadcast", sent.append)  # what the connected workers get
        view.update(EngineSnapshot(at=1.0, active=2, iteration=1.0))
        assert [(m["iid"], m["snap"]["active"], m["routed"]) for m in sent if m["t"] == "engine"] == [("1", 2, 0)]
    finally:
        await pool.stop(0)
    assert not view.listeners


def test_counts_noted_before_a_policy_switch_are_not_sent_after_it(tmp_path):
    # A reload to least-outstanding (whose choices note nothing) left the row as the last
    # prefix-affinity choice wrote it: the daemon sent that count with every snapshot after, so
    # a later switch back read fewer foreign requests than the engine had.
    from orchestrator.health.engine_state import EngineSnapshot

    pool, view, sent = _pool_publishing_one_instance(tmp_path, Settings(lb_policy="prefix-affinity"))
    table = SharedTable.open(tmp_path / "dataplane" / "table")
    table.use_rows(1)
    WorkerCounts(table, 0).acquire("1")
    stamps = SharedStamps.open(tmp_path / "dataplane" / "turns")
    stamps.note_count("1", 5)  # the last prefix-affinity choice read 5
    view.update(EngineSnapshot(at=1.0, active=5, iteration=1.0))
    assert sent[-1]["routed"] == 5
    # as many workers as the settings want: a reload of the policy alone starts none
    pool._slots = dict.fromkeys(range(Settings().worker_count()))  # type: ignore[assignment]
    pool.apply_settings(Settings(lb_policy="least-outstanding"))
    view.update(EngineSnapshot(at=1.1, active=1, iteration=2.0))
    assert sent[-1]["routed"] == 1  # the count now: no choice reads counts any more
    stamps.note_count("1", 5)  # a worker not yet reloaded, choosing once more by the old policy
    view.update(EngineSnapshot(at=1.2, active=1, iteration=3.0))
    assert sent[-1]["routed"] == 1
    pool.apply_settings(Settings(lb_policy="prefix-affinity"))
    view.update(EngineSnapshot(at=1.3, active=1, iteration=4.0))
    assert sent[-1]["routed"] == 1  # until a choice of the new policy notes its count
    stamps.note_count("1", 2)
    view.update(EngineSnapshot(at=1.4, active=2, iteration=5.0))
    assert sent[-1]["routed"] == 2


# --- the feed ------------------------------------------------------------------------------------
async def test_feed_catch_up_broadcast_reports_and_reconnect(tmp_path):
    path = tmp_path / "feed.sock"
    got_by_daemon: list[tuple[int, dict]] = []
    server = FeedServer(path, on_connect=lambda slot, hello: [{"t": "members", "n": 1}],
                        on_message=lambda slot, msg: got_by_daemon.append((slot, msg)))
    await server.start()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    got: list[dict] = []
    states: list[bool] = []
    client = FeedClient(path, lambda: {"t": "hello", "slot": 3}, got.append, states.append)
    task = asyncio.create_task(client.run())
    try:
        await wait_until(lambda: got)
        assert got == [{"t": "members", "n": 1}] and server.connected() == {3}
        server.broadcast({"t": "members", "n": 2})
        assert server.send(3, {"t": "drain"}) and not server.send(4, {"t": "drain"})
        client.send({"t": "health", "iid": "0", "ok": False})
        await wait_until(lambda: len(got) == 3 and got_by_daemon)
        assert got[1:] == [{"t": "members", "n": 2}, {"t": "drain"}]
        assert got_by_daemon == [(3, {"t": "health", "iid": "0", "ok": False})]
        await server.stop()  # the daemon goes away: the worker notices and keeps trying
        await wait_until(lambda: states == [True, False])
        server2 = FeedServer(path, on_connect=lambda slot, hello: [{"t": "members", "n": 9}],
                             on_message=lambda slot, msg: None)
        await server2.start()
        await wait_until(lambda: got[-1] == {"t": "members", "n": 9})
        assert states == [True, False, True] and client.connects == 2
        await server2.stop()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def wait_until(predicate, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


# --- settings ------------------------------------------------------------------------------------
def test_worker_count_auto_leaves_cores_to_the_engines():
    s = Settings()
    assert s.proxy_workers == "auto"
    assert [s.worker_count(c) for c in (1, 2, 4, 16, 64, 128)] == [1, 1, 1, 4, 16, 16]
    assert Settings(proxy_workers="12").worker_count(2) == 12


@pytest.mark.parametrize("value", ["0", "65", "many", "-1"])
def test_bad_worker_count_is_one_line_naming_the_field(value):
    with pytest.raises(UsageError) as err:
        Settings(proxy_workers=value)
    assert "--proxy-workers" in str(err.value) and value in str(err.value)


def test_settings_travel_to_workers_whole():
    s = Settings(proxy_workers="3", lb_policy="round-robin", trusted_proxy=("10.0.0.0/8",))
    assert settings_from_json(settings_to_json(s)) == s


def test_traffic_reaches_the_daemon_once_per_stats_message(tmp_path):
    m = WorkerMembership(ReadyBackends(), SharedTable.create(tmp_path / "t"), lambda msg: None, threshold=3)
    m.set_connected(True)
    m.on_members(member_list(3))
    for _ in range(5):
        m.backends.current()[2].health.success()
    assert m.take_served() == ["2"] and m.take_served() == []


def test_the_away_prober_takes_a_silent_instance_out_for_every_worker_and_back_when_it_answers(tmp_path):
    import logging

    from orchestrator.config import Settings
    from orchestrator.dataplane.away_probe import AwayProber
    clock = Clock()
    table, w0, w1 = two_workers_away(tmp_path, clock)
    aborted = []
    prober = AwayProber(w0, table, lambda host, port, reason: aborted.append((port, reason)),
                        logging.getLogger("test"), clock=clock)
    s = Settings(probe_interval_s=0.5, probe_timeout_s=0.5, probe_failures=3)
    silent = w0.published()[1]
    for i in range(3):
        assert [b.instance_id for b in w0.backends.current()] == ["0", "1", "2"], i  # not before 3 failures
        for b in w0.published():
            prober.judge(b, b is not silent, "GET /v2/health/live: timeout after 0.5s", s)
    assert [b.instance_id for b in w0.backends.current()] == ["0", "2"]
    w1.refresh()  # another worker's heartbeat tick: out there too
    assert [b.instance_id for b in w1.backends.current()] == ["0", "2"]
    assert aborted == [(silent.http_port, "3 failed probes: GET /v2/health/live: timeout after 0.5s")]
    # Kept out while it fails (renewed per probe), back at its first answer.
    clock.t += 30
    prober.judge(silent, False, "timeout", s)
    w1.refresh()
    assert [b.instance_id for b in w1.backends.current()] == ["0", "2"] and len(aborted) == 1
    prober.judge(silent, True, "", s)
    w1.refresh()
    assert [b.instance_id for b in w1.backends.current()] == ["0", "1", "2"]


async def test_the_away_prober_ends_by_itself_once_a_daemon_is_connected(tmp_path):
    """Its owner cancels it when a daemon connects; a cancel that is lost must not leave it
    ejecting instances beside the daemon."""
    import logging

    from orchestrator.dataplane.away_probe import AwayProber
    table = SharedTable.create(tmp_path / "t")
    m = WorkerMembership(ReadyBackends(), table, lambda msg: None, threshold=3)
    m.set_connected(False)
    prober = AwayProber(m, table, lambda host, port, reason: None, logging.getLogger("test"))
    task = asyncio.create_task(prober.run(Settings(probe_interval_s=0.05)))
    await asyncio.sleep(0.15)
    assert not task.done()  # no daemon: it probes on
    m.set_connected(True)  # and no cancel
    await asyncio.wait_for(task, 2)


def test_prefix_depths_are_found_by_bisection_as_a_walk_would(tmp_path):
    """Holders of nested prefixes of one chain (as prompts of one conversation are): each holder's
    depth and the time it was last routed its deepest chunk, as reading every chunk would give."""
    clock = Clock()
    idx = SharedPrefixIndex.create(tmp_path / "p", slots=4096, clock=clock)
    text = "".join(f"turn {i}: " + "words " * 60 for i in range(40))

    def chain(n: int) -> list:  # an n-chunk prompt's keys, as the proxy hashes one
        return chunk_keys(text[:n * DEFAULT_CHUNK_CHARS])

    routed = {"0": 40, "1": 17, "2": 1, "4": 26}  # a key keeps 4 holders
    records = []  # (instance, chunks, when), in order
    for iid, depth in routed.items():
        clock.t += 1
        idx.record(chain(depth), iid)
        records.append((iid, depth, clock.t))
    clock.t += 1
    idx.record(chain(9), "0")  # its first 9 chunks again, later
    records.append(("0", 9, clock.t))

    def walk(n: int) -> dict:
        """Every recorded position of an n-chunk prompt read in order: each holder's depth is one
        past the last it holds, its time when that position was last routed to it."""
        last: dict[str, dict[int, float]] = {}
        for iid, depth, t in records:
            for p in recorded(depth):
                last.setdefault(iid, {})[p] = t
        out = {}
        for iid, held in last.items():
            deepest = None
            for p in recorded(n):
                if p not in held:
                    break
                deepest = p
            if deepest is not None:
                out[iid] = (deepest + 1, held[deepest])
        return out

    for n in (40, 30, 17, 12, 9, 2, 1):
        assert idx.match_recency(chain(n)) == (n, walk(n))
    # a prefix is found at the deepest position both prompts record: instance 1 was routed 17
    # chunks, a 30-chunk prompt sharing them reads positions 0, 1, 3, 7, 15, 23, 29
    assert walk(30)["1"][0] == 16 and walk(17)["1"][0] == 17
    assert idx.match_recency(keys("other", 5)) == (5, {})
    assert idx.match_recency([]) == (0, {})


def test_prefix_recorded_again_within_the_rewrite_window_is_not_rewritten(tmp_path):
    """The Python slots' saving (the compiled ones write every time: test_prefix_slots.py)."""
    from orchestrator.dataplane.shared_prefix import REWRITE_S
    clock = Clock()
    a = SharedPrefixIndex.create(tmp_path / "p", slots=1024, clock=clock, native=False)
    a.record(keys("x", 3), "1")
    clock.t += REWRITE_S / 2
    a.record(keys("x", 3), "1")  # a hot prefix: its time is not written again so soon
    assert a.match_recency(keys("x", 3)) == (3, {"1": (3, 1000.0)})
    a.record(keys("x", 3), "2")  # another instance is written at once
    assert a.match_recency(keys("x", 3))[1]["2"] == (3, 1000.0 + REWRITE_S / 2)
    clock.t += REWRITE_S
    a.record(keys("x", 3), "1")
    assert a.match_recency(keys("x", 3))[1]["1"] == (3, clock.t)


def test_prefix_recorded_right_after_a_restart_counts(tmp_path):
    clock, a, b = two_workers_index(tmp_path)
    a.record(keys("x", 2), "1")
    clock.t += 0.001
    b.forget_instance("1")  # another worker saw it restart
    clock.t += 0.001
    a.record(keys("x", 2), "1")  # within the rewrite window, but its earlier write is void
    assert b.match(keys("x", 2)) == (2, {"1": 2})


def test_an_all_zero_key_is_matched_as_it_is_recorded(tmp_path):
    """The empty slot's key stands for no key: record() stores an all-zero digest under another
    key, and match() looks it up under the same one."""
    clock, a, b = two_workers_index(tmp_path)
    a.record([bytes(16)], "2")
    assert b.match([bytes(16)]) == (1, {"2": 1})


@pytest.mark.parametrize("front", ["auto", "compiled", "aiohttp"])
def test_status_names_a_worker_that_runs_no_compiled_front_where_one_was_asked(tmp_path, front):
    """--front auto where the module was not built: the worker serves through aiohttp (one
    warning in its log), and the pool's status says so once its stats have come; not before
    them, not for a worker asked for aiohttp, not for one whose front runs."""
    from orchestrator.controlplane.workers import WorkerPool, _Slot

    class Alive:
        pid, returncode = 4242, None

    pool = WorkerPool(Settings(listen="127.0.0.1:0", metrics_listen="", grpc_listen="", front=front),
                      ReadyBackends(), tmp_path)
    pool._slots = {0: _Slot(0, proc=Alive()), 1: _Slot(1, proc=Alive(), stats={"front_served": None}),
                   2: _Slot(2, proc=Alive(), stats={"front_served": 12})}
    missing = [w["front_missing"] for w in pool.status()["workers"]]
    assert missing == ([False, False, False] if front == "aiohttp" else [False, True, False])
