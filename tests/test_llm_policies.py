"""kv-aware and prefix-affinity routing on recorded engine snapshots; the prefix index;
the prompt readers for HTTP JSON and gRPC protobuf."""

from __future__ import annotations

import json
import random

import pytest

from orchestrator.health.engine_state import EngineSnapshot, EngineView
from orchestrator.routing.backends import Backend
from orchestrator.routing.balancer import Balancer
from orchestrator.routing.llm_policies import KvAware, PrefixAffinity, RouteHints, loads, requests
from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
from orchestrator.routing.prefix_index import DEFAULT_CHUNK_CHARS, PrefixIndex, chunk_keys
from orchestrator.routing.prompt import prompt_of_grpc, prompt_of_json

pytestmark = pytest.mark.unit

NOW = 100.0


def backend(iid: str, snap: EngineSnapshot | None = None) -> Backend:
    view = EngineView(stale_after_s=1.0)
    if snap is not None:
        view.update(snap)
    return Backend(iid, "127.0.0.1", 1, 2, 3, engine=view)


def snap(active=0, waiting=0, max_active=8, kv_used=0, kv_max=100, at=NOW, iteration=1.0):
    return EngineSnapshot(at=at, active=active, waiting=waiting, max_active=max_active, kv_used=kv_used,
                          kv_max=kv_max, iteration=iteration)


def test_a_workers_policy_notes_no_counts_until_a_snapshot_comes_without_the_daemons(tmp_path):
    """A data-plane worker's policy (shared turns) routes on snapshots the daemon sends with its
    count: it notes nothing from the start, where its instances export no TRT-LLM numbers (none
    ever comes) as where they do; snapshots without the count (columns the table lacks) start notes."""
    from orchestrator.dataplane.shared_stamps import SharedStamps
    from orchestrator.routing.llm_policies import SharedTurns

    clock = [NOW]
    a, b = backend("0"), backend("1")
    policy = PrefixAffinity(random.Random(1), clock=lambda: clock[0],
                            turns=SharedTurns(SharedStamps.create(tmp_path / "turns")))
    history = policy.history
    for k in range(3):  # no snapshot: routed by our counts alone
        clock[0] = NOW + 0.01 * k
        assert policy.choose([a, b], (), {"0": k + 1, "1": 0}).instance_id == "1"
    assert not history.noting and history.at("0", NOW + 0.05) is None
    a.engine.update(snap(active=2, at=NOW + 0.05))  # no `routed`: not the daemon's
    b.engine.update(snap(active=0, at=NOW + 0.05))
    clock[0] = NOW + 0.1
    policy.choose([a, b], (), {"0": 2, "1": 0})
    assert history.noting and history.at("0", NOW + 0.1) == 2


def test_loads_add_foreign_work_and_kv_pressure():
    a = backend("0", snap(active=6, waiting=2, kv_used=50))
    b = backend("1", snap(active=1))
    load = loads([a, b], {"0": 2, "1": 1}, NOW)
    # a: ours 2 + foreign (6 - 2; its 2 waiting are among the 6 active) + 0.5 * 8 * 0.5;
    # b: ours 1, nothing foreign
    assert load == {"0": 2 + 4 + 2.0, "1": 1.0}


def test_requests_waiting_for_kv_blocks_are_ours_not_foreign():
    # TRT-LLM's waiting is active minus scheduled: all 8 active are the 8 we sent, 3 of
    # them waiting for KV blocks. Counted again, they were 3 foreign requests.
    a = backend("0", snap(active=8, waiting=3))
    b = backend("1", snap(active=8))
    assert loads([a, b], {"0": 8, "1": 8}, NOW) == {"0": 8.0, "1": 8.0}
    assert requests([a, b], {"0": 8, "1": 8}, NOW) == {"0": 8.0, "1": 8.0}


def test_a_snapshot_counts_ours_as_the_daemon_read_them_not_as_this_worker_last_saw():
    # Worker B chose once while instance "1" had 4 of worker A's requests and "0" none; then A
    # sent 3 to "0". The snapshots hold 3 and 4, all of them ours (`routed`, read by the daemon
    # as it published them). By B's own notes "0" had one of ours then (B's own pick), so two of
    # A's 3 were foreign: 5 against 4, and B sent the next to the busier instance.
    clock = [NOW - 0.5]
    a, b = backend("0"), backend("1")
    policy = PrefixAffinity(random.Random(1), clock=lambda: clock[0])
    inflight = {"0": 0, "1": 4}
    assert policy.choose([a, b], (), inflight).instance_id == "0"  # B's pick, ended at once
    inflight["0"] = 3  # worker A's
    a.engine.update(EngineSnapshot(at=NOW - 0.1, active=3, max_active=8, kv_max=100, iteration=1.0, routed=3))
    b.engine.update(EngineSnapshot(at=NOW - 0.1, active=4, max_active=8, kv_max=100, iteration=1.0, routed=4))
    clock[0] = NOW
    assert requests([a, b], inflight, NOW, policy.history) == {"0": 3.0, "1": 4.0}
    assert policy.choose([a, b], (), inflight).instance_id == "0"
    # What the engine holds beyond the daemon's count is another client's.
    a.engine.update(EngineSnapshot(at=NOW, active=5, max_active=8, kv_max=100, iteration=1.0, routed=3))
    assert requests([a, b], inflight, NOW + 0.01)["0"] == 3 + 2


def test_counts_are_noted_only_while_the_snapshots_come_without_the_daemons_count():
    """A policy's notes of its counts stand in for the daemon's (EngineSnapshot.routed): where the
    snapshots carry it (a data-plane worker's) no choice notes its candidates (1.5-2 us of a
    decision at 16); snapshots without it again (an older daemon) start the notes afresh."""
    clock = [NOW - 0.5]
    a, b = backend("0"), backend("1")
    policy = KvAware(random.Random(1), clock=lambda: clock[0])
    history = policy.history
    policy.choose([a, b], (), {"0": 0, "1": 0})  # no snapshot yet: noted
    assert history.noting and history.at("0", NOW - 0.5) is not None
    for view, n in ((a.engine, 1), (b.engine, 0)):
        view.update(EngineSnapshot(at=NOW - 0.4, active=n, max_active=8, kv_max=100, iteration=1.0, routed=n))
    for k, inflight in enumerate(({"0": 1, "1": 0}, {"0": 1, "1": 1}, {"0": 2, "1": 2})):
        clock[0] = NOW - 0.3 + 0.01 * k
        policy.choose([a, b], (), inflight)
    assert not history.noting
    assert history.at("0", NOW - 0.3) == history.at("0", NOW - 0.5)  # nothing noted since
    a.engine.update(snap(active=2, at=NOW - 0.1))
    b.engine.update(snap(active=2, at=NOW - 0.1))
    clock[0] = NOW
    # the notes before the pause are not taken to hold through it: 0 foreign against 2 of ours
    assert policy.choose([a, b], (), {"0": 2, "1": 2}) is not None
    assert history.noting and history.at("0", NOW - 0.5) is None
    assert history.at("0", NOW) is not None and history.at("1", NOW) is not None
    assert requests([a, b], {"0": 2, "1": 2}, NOW, history) == {"0": 2.0, "1": 2.0}


def test_counts_are_noted_while_any_instances_snapshots_come_without_the_daemons_count():
    """Where the daemon has a count for some instances and not for others (ids beyond the shared
    table's columns), the notes go on for as long as one instance's snapshots lack it, and are
    kept between snapshots (each snapshot turned them on or off for all, and every turn on
    cleared them); they stop once every instance's latest snapshot carries it, or the one without
    it has left the ready set."""
    clock = [NOW - 0.5]
    a, b = backend("0"), backend("1")
    policy = KvAware(random.Random(1), clock=lambda: clock[0])
    history = policy.history
    for k in range(6):
        clock[0] = NOW - 0.4 + 0.05 * k
        a.engine.update(EngineSnapshot(at=clock[0] - 0.01, active=1, max_active=8, kv_max=100, iteration=1.0,
                                       routed=1))
        b.engine.update(snap(active=1, at=clock[0] - 0.01))  # no count from the daemon
        policy.choose([a, b], (), {"0": 1 + k % 2, "1": 1})
        assert history.noting
    # the notes of every choice are still there: nothing cleared them between snapshots
    assert history.at("0", NOW - 0.4) is not None and history.at("0", NOW - 0.15) is not None
    b.engine.update(EngineSnapshot(at=NOW - 0.1, active=1, max_active=8, kv_max=100, iteration=1.0, routed=1))
    clock[0] = NOW
    policy.choose([a, b], (), {"0": 1, "1": 1})
    assert not history.noting  # every instance's latest snapshot carries the daemon's count
    b.engine.update(snap(active=1, at=NOW + 0.05))
    clock[0] = NOW + 0.1
    policy.choose([a, b], (), {"0": 1, "1": 1})
    assert history.noting
    policy.forget("1")  # it left the ready set: a's next snapshot, with the count, stops the notes
    a.engine.update(EngineSnapshot(at=NOW + 0.15, active=1, max_active=8, kv_max=100, iteration=1.0, routed=1))
    clock[0] = NOW + 0.2
    policy.choose([a], (), {"0": 1})
    assert not history.noting


def test_one_stale_snapshot_means_inflight_counts_for_everyone():
    a = backend("0", snap(active=8, at=NOW - 5))  # stale
    b = backend("1", snap(active=8))
    assert loads([a, b], {"0": 3, "1": 1}, NOW) == {"0": 3.0, "1": 1.0}


def test_kv_aware_avoids_the_instance_whose_engine_is_full():
    full = backend("0", snap(active=8, waiting=4, kv_used=95))
    idle = backend("1", snap(active=1, kv_used=10))
    policy = KvAware(random.Random(1), clock=lambda: NOW)
    picks = {policy.choose([full, idle], (), {}).instance_id for _ in range(20)}
    assert picks == {"1"}


def test_kv_aware_uses_kv_fraction_to_break_equal_slots():
    a = backend("0", snap(active=2, kv_used=90))
    b = backend("1", snap(active=2, kv_used=10))
    assert KvAware(random.Random(1), clock=lambda: NOW).choose([a, b], (), {}).instance_id == "1"


def test_kv_aware_skips_and_returns_none_when_nothing_left():
    a, b = backend("0", snap()), backend("1", snap())
    policy = KvAware(random.Random(1), clock=lambda: NOW)
    assert policy.choose([a, b], {"0"}, {}).instance_id == "1"
    assert policy.choose([a, b], {"0", "1"}, {}) is None


SYSTEM = "You are a helpful assistant for tenant {0}. " * 40  # ~1.6k chars: several chunks


def hints(tenant: int, question: str) -> RouteHints:
    return RouteHints.from_prompt(SYSTEM.format(tenant) + question)


def test_prefix_affinity_follows_the_instance_that_served_the_prefix():
    a, b = backend("0", snap()), backend("1", snap())
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    first = policy.choose([a, b], (), {}, hints(7, "q1")).instance_id
    assert policy.last_reason == "prefix-miss"
    for i in range(10):
        assert policy.choose([a, b], (), {}, hints(7, f"question {i}")).instance_id == first
        assert policy.last_reason == "prefix"


def test_prefix_affinity_spreads_tenants_by_load():
    a, b = backend("0"), backend("1")  # no engine data: in-flight counts
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    inflight: dict[str, int] = {}
    owner = {}
    for tenant in range(8):
        chosen = policy.choose([a, b], (), inflight, hints(tenant, "q")).instance_id
        inflight[chosen] = inflight.get(chosen, 0) + 1  # they stay in flight
        owner[tenant] = chosen
    assert sorted(owner.values()).count("0") == 4  # least loaded each time: an even split


def test_starvation_guard_leaves_an_overloaded_holder():
    a, b = backend("0"), backend("1")
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW, slack=4)
    holder = policy.choose([a, b], (), {}, hints(1, "q")).instance_id
    other = "1" if holder == "0" else "0"
    inflight = {holder: 4, other: 0}
    assert policy.choose([a, b], (), inflight, hints(1, "q2")).instance_id == holder  # within slack
    inflight = {holder: 5, other: 0}
    assert policy.choose([a, b], (), inflight, hints(1, "q3")).instance_id == other
    assert policy.last_reason == "prefix-overloaded"
    # Both hold the prefix now: the less loaded holder wins.
    assert policy.choose([a, b], (), {holder: 3, other: 1}, hints(1, "q4")).instance_id == other


@pytest.mark.parametrize("prompt", [None, "x" * 3000], ids=["no-prompt", "prefix-miss"])
def test_ties_are_taken_in_turn_not_at_random(prompt):
    # Two idle engines, requests that finish before the next comes (open loop, light load):
    # every choice is a tie. At random, runs of them landed on one instance (in the simulator
    # 4-10% on TTFT p90 against NGINX's least_conn, which takes its equals in turn).
    a, b = backend("0", snap()), backend("1", snap())
    for policy in (PrefixAffinity(random.Random(3), clock=lambda: NOW), KvAware(random.Random(3), clock=lambda: NOW)):
        picks = []
        for i in range(12):
            hint = RouteHints.from_prompt(f"{i:04d}" + prompt) if prompt else None
            picks.append(policy.choose([a, b], (), {}, hint).instance_id)
            if isinstance(policy, PrefixAffinity):
                policy.forget(picks[-1])  # no holder: a tie by requests every time
        assert all(x != y for x, y in zip(picks, picks[1:])), picks
        # a third instance joining the tie comes first: it was never chosen
        c = backend("2", snap())
        assert policy.choose([a, b, c], (), {}, None).instance_id == "2"


def test_holders_of_the_same_depth_are_told_apart_by_requests_not_kv():
    # Both hold the tenant's prefix (s64/room1.5/uniform: every instance caches every tenant).
    # "0" runs fewer requests, but longer ones fill more of its cache: by the KV-weighted load
    # (4 + 0.5 * 64 * 0.5 = 20 against 6 + 0.5 * 64 * 0.1 = 9.2) "1" looked lighter, and the
    # choice had nothing to do with the cache: both hold it. TTFT follows the requests there.
    a = backend("0", snap(active=4, max_active=64, kv_used=50))
    b = backend("1", snap(active=6, max_active=64, kv_used=10))
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    policy.index.record(hints(5, "q").prompt_keys, "0")
    policy.index.record(hints(5, "q").prompt_keys, "1")
    for i in range(5):
        assert policy.choose([a, b], (), {"0": 4, "1": 6}, hints(5, f"q{i}")).instance_id == "0"
        assert policy.last_reason == "prefix"


def test_a_holder_holding_requests_back_for_kv_blocks_is_passed_over_for_an_idle_instance():
    # s8/room1.5/chat/r0 in the simulator: a conversation's holder has as many long histories
    # running as its KV cache admits, and the next turn waits there for blocks (TTFT p90 1.48 x
    # NGINX's) while the other instance has nothing to do. A prefill at once beats a cached
    # prompt that waits for a running request to finish.
    blocked = backend("0", snap(active=3, waiting=1))
    idle = backend("1", snap())
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    policy.index.record(hints(2, "turn 1").prompt_keys, "0")
    assert policy.choose([blocked, idle], (), {"0": 3}, hints(2, "turn 2")).instance_id == "1"
    assert policy.last_reason == "prefix-kv-wait"


@pytest.mark.parametrize("case", ["other-busy", "holder-admits", "stale"])
def test_a_holder_keeps_its_prefix_unless_it_waits_for_kv_and_another_stands_idle(case):
    holder = backend("0", snap(active=3, waiting=0 if case == "holder-admits" else 1,
                               at=NOW - 5 if case == "stale" else NOW))
    other = backend("1", snap())
    inflight = {"0": 3, "1": 1 if case == "other-busy" else 0}
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    policy.index.record(hints(2, "turn 1").prompt_keys, "0")
    assert policy.choose([holder, other], (), inflight, hints(2, "turn 2")).instance_id == "0"
    assert policy.last_reason == "prefix"


def _turns(history_chars: int, new_chars: int) -> tuple[RouteHints, RouteHints]:
    """A conversation's turn (its history) and the next one (the history + `new_chars` more)."""
    history = "".join(f"turn {i}: " + "x" * 40 + "\n" for i in range(history_chars // 49 + 1))[:history_chars]
    more = "".join(f"reply {i}: " + "y" * 40 + "\n" for i in range(new_chars // 50 + 1))[:new_chars]
    return RouteHints.from_prompt(history), RouteHints.from_prompt(history + more)


def test_a_full_holder_of_a_small_share_of_a_chat_turn_is_passed_over_for_a_free_slot():
    # s8/room4/chat/closed in the simulator: a conversation's holder runs a request in each of its
    # 8 slots, and the next turn, of which it holds the first third, waited there for a slot
    # (TTFT p90 1.076 x the best baseline's) while the other instance had one free.
    turn, following = _turns(768, 1536)
    full, free = backend("0", snap(active=8)), backend("1", snap(active=5))
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    policy.index.record(turn.prompt_keys, "0")
    assert policy.choose([full, free], (), {"0": 8, "1": 5}, following).instance_id == "1"
    assert policy.last_reason == "prefix-full"


@pytest.mark.parametrize("case", ["holder-has-a-slot", "all-full", "most-of-the-prompt", "stale"])
def test_a_holder_keeps_a_chat_turn_unless_it_is_full_holds_little_of_it_and_a_slot_is_free(case):
    turn, following = _turns(2304 if case == "most-of-the-prompt" else 768, 1536)
    holder = backend("0", snap(active=7 if case == "holder-has-a-slot" else 8, at=NOW - 5 if case == "stale" else NOW))
    other = backend("1", snap(active=8 if case == "all-full" else 5))
    inflight = {"0": 7 if case == "holder-has-a-slot" else 8, "1": 8 if case == "all-full" else 5}
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    policy.index.record(turn.prompt_keys, "0")
    assert policy.choose([holder, other], (), inflight, following).instance_id == "0"
    assert policy.last_reason == "prefix"


def test_one_hot_prefix_still_uses_every_instance_under_load():
    backends = [backend(str(i)) for i in range(4)]
    policy = PrefixAffinity(random.Random(5), clock=lambda: NOW, slack=2)
    inflight: dict[str, int] = {}
    for i in range(40):  # one tenant, nothing finishes: load builds up
        chosen = policy.choose(backends, (), inflight, hints(0, f"q{i}")).instance_id
        inflight[chosen] = inflight.get(chosen, 0) + 1
    mean = 40 / 4
    assert min(inflight.get(b.instance_id, 0) for b in backends) >= mean / 2, inflight


def test_forgetting_an_instance_drops_its_prefixes():
    a, b = backend("0"), backend("1")
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    holder = policy.choose([a, b], (), {}, hints(2, "q")).instance_id
    policy.forget(holder)
    policy.choose([a, b], (), {}, hints(2, "q"))
    assert policy.last_reason == "prefix-miss"


def test_no_prompt_routes_by_load():
    a, b = backend("0"), backend("1")
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    assert policy.choose([a, b], (), {"0": 1}, None).instance_id == "1"
    assert policy.last_reason == "no-prompt"


@pytest.mark.parametrize("prompt", [None, "x" * 3000], ids=["no-prompt", "prefix-miss"])
def test_no_cached_prefix_means_the_fewest_requests_whatever_kv_the_running_ones_hold(prompt):
    # Closed loop, 16 users on 2 x 8 slots: "0" runs a 3000-token prompt among its 7, "1" is
    # full with 8 short ones. Counting the long prompt's KV blocks as load (7 + 0.5 * 8 * 0.6
    # = 9.4 against 8 + 0.8) sent the next request to "1", to wait for a slot while "0" had one.
    a = backend("0", snap(active=7, kv_used=60))
    b = backend("1", snap(active=8, kv_used=10))
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    for _ in range(10):
        assert policy.choose([a, b], (), {"0": 7, "1": 8}, RouteHints.from_prompt(prompt)).instance_id == "0"
        assert policy.last_reason == ("no-prompt" if prompt is None else "prefix-miss")
        policy.forget("0")


def test_no_cached_prefix_still_counts_work_we_did_not_send():
    a = backend("0", snap(active=6))  # 4 of them another proxy's
    b = backend("1", snap(active=3))
    policy = PrefixAffinity(random.Random(3), clock=lambda: NOW)
    assert policy.choose([a, b], (), {"0": 2, "1": 3}, None).instance_id == "1"


def test_index_is_bounded_and_ages_out():
    t = [0.0]
    index = PrefixIndex(max_chunks=6, ttl_s=5, clock=lambda: t[0])
    keys = chunk_keys("x" * 256 * 8)
    index.record(keys, "0")  # 4 keys: 8 chunks are recorded at 1, 2, 4 and 8 (prefix_index.recorded)
    assert index.match(keys) == (8, {"0": 8})
    index.record(chunk_keys("y" * 256 * 8), "1")
    assert len(index) == 6  # oldest keys of the first prompt evicted
    assert index.match(keys)[1] == {}  # its first chunk went: the chain is broken
    t[0] = 10.0
    assert index.match(chunk_keys("y" * 256 * 8))[1] == {}  # aged out


@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "shared"])
def test_a_prefix_is_found_at_the_deepest_position_both_prompts_record(shared, tmp_path):
    index = SharedPrefixIndex.create(tmp_path / "p", slots=4096) if shared else PrefixIndex()
    text = "".join(f"line {i}: " + "words " * 60 for i in range(64))
    routed = chunk_keys(text[:20 * 256])  # 20 chunks: positions 0, 1, 3, 7, 15 and 19 digested
    assert [p for p, k in enumerate(routed) if k is not None] == [0, 1, 3, 7, 15, 19]
    index.record(routed, "3")
    assert index.match(routed) == (20, {"3": 20})  # the same prompt: whole
    # A longer prompt sharing those 20 chunks reads 0, 1, 3, 7, 15, 23, 31, ...: 16 found (the
    # price of writing 6 keys, not 20), a shorter one its own last position 11 is not recorded: 8.
    assert index.match(chunk_keys(text))[1] == {"3": 16}
    assert index.match(chunk_keys(text[:12 * 256]))[1] == {"3": 8}
    # the keys digested are the chain's, whatever the prompt's length
    assert chunk_keys(text)[15] == routed[15] and chunk_keys(text)[19] is None


def test_chunk_keys_are_a_chain():
    k1 = chunk_keys("a" * 256 + "b" * 256)
    k2 = chunk_keys("c" * 256 + "b" * 256)
    assert len(k1) == 2 and k1[1] != k2[1]  # the same second chunk after another first one
    assert chunk_keys("short") == []


def test_each_chunk_key_is_the_digest_of_the_whole_prefix_up_to_it():
    """The incremental digests are those of each prefix hashed alone: what two workers, or a
    worker before and after a restart, compute for the same prompt is the same."""
    from xxhash import xxh3_128
    text = "".join(f"{i} \u00e9\u4e16 " for i in range(3000))  # multi-byte characters across chunk edges
    keys = chunk_keys(text)
    assert len(keys) == 64 and sum(k is not None for k in keys) == 11
    for p, key in enumerate(keys):
        if key is not None:
            assert key == xxh3_128(text[:(p + 1) * DEFAULT_CHUNK_CHARS].encode()).digest()


def test_prompt_of_json_generate_and_infer():
    assert prompt_of_json(json.dumps({"text_input": "hi", "max_tokens": 3}).encode()) == "hi"
    infer = {"inputs": [{"name": "max_tokens", "data": [3]}, {"name": "text_input", "data": [["hello"]]}]}
    assert prompt_of_json(json.dumps(infer).encode()) == "hello"
    assert prompt_of_json(b"not json") is None and prompt_of_json(b"[1]") is None
    assert prompt_of_json(b"") is None


@pytest.mark.parametrize("body", [
    b'{"text_input": "caf\xc3\xa9 \\u00e9"}', b'{"text_input": "hi"} trailing', b'{"text_input": "\xff"}',
    '{"text_input": "hi"}'.encode("utf-16-le"), '{"text_input": "hi"}'.encode("utf-32-le"),
    b'{"text_input": "\\ud800 alone"}', b'\n{"text_input": ["a", "b"], "text_input": "last"}',
    b'{"text_input": "x", "temperature": NaN}', b'{"text_input": "x", "seed": 123456789012345678901234567890}',
    b'{"text_input": "x", "deep": ' + b"[" * 2000 + b"]" * 2000 + b"}"],
    ids=["utf8-escapes", "trailing", "bad-utf8", "utf16", "utf32", "lone-surrogate", "repeated-key", "nan",
         "big-int", "too-deep"])
def test_prompt_of_json_reads_what_json_loads_reads(body):
    try:
        doc = json.loads(body)
        expected = doc.get("text_input") if isinstance(doc, dict) else None
    except (ValueError, UnicodeDecodeError, RecursionError):  # too deep for json: no prompt, no error
        expected = None
    assert prompt_of_json(body) == expected


def test_prefix_affinity_wants_no_prompt_shorter_than_a_chunk_and_routes_it_as_none():
    bal = Balancer("prefix-affinity", rng=random.Random(1))
    assert not bal.wants_prompt_of(DEFAULT_CHUNK_CHARS - 1) and bal.wants_prompt_of(DEFAULT_CHUNK_CHARS)
    assert Balancer("cost-model").wants_prompt_of(1) and not Balancer("least-outstanding").wants_prompt_of(10**6)
    reloaded = Balancer("least-outstanding")
    reloaded.set_policy("prefix-affinity")  # the threshold is the policy's, worked out again
    assert reloaded.wants_prompt and reloaded.wants_prompt_of(DEFAULT_CHUNK_CHARS)
    reloaded.set_policy("round-robin")
    assert not reloaded.wants_prompt and not reloaded.wants_prompt_of(10**6)
    # the widest prompt a short body can carry: it has no key, and routes as no prompt at all
    short = RouteHints.from_prompt("é" * (DEFAULT_CHUNK_CHARS - 1))
    assert short.prompt_keys == () and short.route_key
    with_hints, without = (PrefixAffinity(random.Random(2), clock=lambda: NOW) for _ in range(2))
    backends = [backend(str(i)) for i in range(3)]
    for inflight in ({}, {"0": 1}, {"0": 1, "2": 1}, {"1": 2}, {}):
        assert (with_hints.choose(backends, (), inflight, short).instance_id
                == without.choose(backends, (), inflight, None).instance_id)
        assert with_hints.last_reason == without.last_reason == "no-prompt"


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_prompt_of_grpc_raw_and_inline_contents():
    text = "the prompt".encode()
    tensor = lambda name: _field(1, name.encode()) + _field(2, b"BYTES")  # noqa: E731
    raw = (_field(1, b"ensemble") + _field(3, tensor("max_tokens")) + _field(3, tensor("text_input"))
           + _field(7, (3).to_bytes(4, "little")) + _field(7, len(text).to_bytes(4, "little") + text))
    assert prompt_of_grpc(raw) == "the prompt"
    inline = _field(1, b"ensemble") + _field(3, tensor("text_input") + _field(5, _field(8, text)))
    assert prompt_of_grpc(inline) == "the prompt"
    assert prompt_of_grpc(b"\xff\xff\xff") is None and prompt_of_grpc(_field(1, b"m")) is None


def test_foreign_work_is_counted_against_what_we_had_in_flight_when_the_engine_was_scraped():
    # The snapshot (50 ms old) shows the 3 requests we had there then; 2 have finished since.
    a = backend("0", snap(active=3, at=NOW - 0.05))
    b = backend("1", snap(active=1, at=NOW - 0.05))
    policy = KvAware(random.Random(1), clock=lambda: NOW - 0.1)
    assert policy.choose([a, b], {"1"}, {"0": 2, "1": 1}).instance_id == "0"
    # noted: "0" had 3 (2 + the one it just got); "1", skipped, is not noted
    assert loads([a, b], {"0": 1, "1": 1}, NOW, policy.history) == {"0": 1.0, "1": 1.0}
    # Without the history, those two finished requests would count as someone else's work.
    assert loads([a, b], {"0": 1, "1": 1}, NOW) == {"0": 3.0, "1": 1.0}
    # Work we never sent still counts.
    c = backend("0", snap(active=6, at=NOW - 0.05))
    assert loads([c, b], {"0": 1, "1": 1}, NOW, policy.history)["0"] == 1 + (6 - 3)


def test_a_snapshot_worked_out_as_it_arrives_counts_as_one_a_decision_works_out():
    """InflightHistory.prime (a listening policy, as a snapshot arrives) must leave the counts a
    decision reads as they are when the decision works the snapshot out itself, notes made
    after its arrival included; one delivered at its own instant is left to the decision."""
    from orchestrator.routing.llm_policies import InflightHistory
    primed, lazy = InflightHistory(), InflightHistory()
    a, b = backend("0"), backend("1", snap(active=2, at=NOW))
    for h in (primed, lazy):
        h.note_choice(NOW - 0.5, "0", 3)
        h.note_choice(NOW - 0.5, "1", 1)
    arrived = snap(active=7, kv_used=40, at=NOW - 0.01)
    a.engine.update(arrived)
    primed.prime("0", arrived, NOW)
    primed.prime("1", b.engine.latest, NOW)  # at NOW itself: not worked out
    assert primed._terms["0"][0] is arrived and "1" not in primed._terms
    for h in (primed, lazy):
        h.note_choice(NOW + 0.001, "0", 5)  # a choice after it arrived: its count rose after the scrape
    for now in (NOW + 0.002, NOW + 0.3):
        assert loads([a, b], {"0": 4, "1": 1}, now, primed) == loads([a, b], {"0": 4, "1": 1}, now, lazy)
        assert requests([a, b], {"0": 4, "1": 1}, now, primed) == requests([a, b], {"0": 4, "1": 1}, now, lazy)
    # foreign work there is the engine's 7 less our 3 when it was scraped, not less our 5 now
    assert requests([a, b], {"0": 4, "1": 1}, NOW + 0.002, primed)["0"] == 4 + (7 - 3)


def test_prefix_affinity_works_a_snapshot_out_as_it_hears_of_it():
    policy = PrefixAffinity(random.Random(1), clock=lambda: NOW)
    arrived = snap(active=3, at=NOW - 0.01)
    policy.observe("0", arrived)
    assert policy.history._terms["0"][0] is arrived


def test_inflight_history_answers_from_a_long_busy_series():
    """Thousands of notes per instance in the kept window (a busy worker): answers as at every
    time, before and after the older notes are let go in bulk."""
    from orchestrator.routing.llm_policies import InflightHistory
    history = InflightHistory(keep_s=2.0)
    truth = []
    for k in range(6000):  # 6 s at 1000 choices a second, the count of "0" going 0..9
        t = 100.0 + k / 1000
        history.note_choice(t, "0", k % 10)
        history.note_choice(t, "1", 1)
        truth.append((t, k % 10))
    now = truth[-1][0]
    for t, n in truth[-1500:]:
        assert history.at("0", t) == n
        assert history.at("0", t + 0.0005) == n  # between two notes: the earlier one's count
    assert history.at("1", now) == 1
    assert history.at("0", now - 2.0) is not None  # the last note at the window's start is kept
    assert history.at("0", 99.0) is None  # nothing noted that early
    assert len(history._series["0"].times) < 6000  # older notes were let go


def _random_state(seed: int, tmp_path, shared: bool):
    """A ready set of 1-8 instances in every state the no-cache choice meets: no view, no snapshot,
    one without TRT-LLM numbers, stale, with and without the daemon's count, terms worked out or
    not; counts missing or not; turns of one policy or the workers' (stamps tied or not)."""
    from orchestrator.dataplane.shared_stamps import SharedStamps
    from orchestrator.routing.llm_policies import InflightHistory, SharedTurns, Turns

    rng = random.Random(seed)
    now = NOW + 5.0
    plain = rng.random() < 0.6  # most states: every snapshot fresh, as a busy deployment's
    backends, inflight = [], {}
    history = InflightHistory()
    for i in range(rng.randint(1, 8)):
        iid = str(i)
        if not plain and rng.random() < 0.1:
            backends.append(Backend(iid, "127.0.0.1", 1, 2, 3, engine=None))
            continue
        view = EngineView(stale_after_s=1.0)
        kind = "fresh" if plain else rng.choice(["fresh", "fresh", "none", "no-engine", "stale"])
        if kind != "none":
            age = 2.0 if kind == "stale" else rng.choice([0.5, 0.1] if plain else [0.5, 0.1, 0.0])
            view.update(EngineSnapshot(
                at=now - age, active=rng.randint(0, 4),
                pending=rng.randint(0, 2), max_active=8, kv_used=rng.randint(0, 100), kv_max=100,
                iteration=None if kind == "no-engine" else 1.0,
                routed=rng.choice([None, rng.randint(0, 4)]) if not shared else rng.randint(0, 4)))
        backends.append(Backend(iid, "127.0.0.1", 1, 2, 3, engine=view))
        if view.latest is not None and rng.random() < (0.98 if plain else 0.6):
            history.prime(iid, view.latest, now)
        if plain or rng.random() < 0.8:  # a worker's counts hold every instance of the ready set
            inflight[iid] = rng.randint(0, 3)
    history.noting = rng.random() < 0.5
    if shared:
        stamps = SharedStamps.create(tmp_path / f"turns-{seed}")
        for b in backends:
            stamps.put(b.instance_id, float(rng.choice([0, 1, 1, 2])))
        turns = SharedTurns(stamps)
        history.shared = stamps
    else:
        turns = Turns()
        for b in rng.sample(backends, len(backends)):
            turns.chosen(b.instance_id, now)
    return backends, inflight, now, history, turns


def _left_behind(history, turns):
    """What a pass leaves: the history's terms and notes, and the turns file."""
    stamps = getattr(turns, "stamps", None)
    return (history.noting, sorted((k, t[1:]) for k, t in history._terms.items()),
            sorted((k, s.times, s.counts) for k, s in history._series.items()),
            bytes(stamps.buffer) if stamps is not None else None)


def _compiled():
    """llm_policies' compiled module, which these tests hold to the Python: it must be built."""
    from orchestrator.routing import llm_policies

    assert llm_policies.NATIVE is not None, \
        "orchestrator/routing/_least_requests.c is not built (scripts/bootstrap builds it)"
    return llm_policies.NATIVE


def _recording(name: str, answers: list):
    """The compiled module with its pass `name` appending each answer to `answers`."""
    real = getattr(_compiled(), name)
    return type("Recording", (), {name: staticmethod(lambda *a: answers.append(real(*a)) or answers[-1])})


@pytest.mark.parametrize("shared", [False, True], ids=["one-policy", "workers"])
def test_the_no_cache_choice_compiled_and_in_python_is_the_least_requests_of_counted(shared, tmp_path, monkeypatch):
    """`_least_requests` (the default's choice where no cache is at stake), compiled and in Python,
    against what it stands for: `_least` over `_counted`'s requests. On random states, each run
    on its own copy: the same instance, and the same terms, notes and turns file left behind."""
    from orchestrator.routing import llm_policies

    decided: list = []  # what the compiled pass answered: an index, a list of ties, or None (the Python's)
    counting = _recording("least", decided)
    for way in ("counted", "python", "compiled"):
        (tmp_path / way).mkdir()
    for seed in range(400):
        outcomes = []
        for way in ("counted", "python", "compiled"):
            backends, inflight, now, history, turns = _random_state(seed, tmp_path / way, shared)
            if way == "counted":
                chosen = llm_policies._least(backends, llm_policies._counted(backends, inflight, now, history,
                                                                               note=True)[0], turns)
            else:
                monkeypatch.setattr(llm_policies, "NATIVE", counting if way == "compiled" else None)
                chosen = llm_policies._least_requests(backends, inflight, now, history, turns)
            outcomes.append((chosen.instance_id, *_left_behind(history, turns)))
        assert outcomes[0] == outcomes[1] == outcomes[2], f"seed {seed}"
    # the compiled pass decided a good share itself, ties included, and left the rest to the Python
    assert sum(type(d) is int for d in decided) > 100 and None in decided, [decided.count(None), len(decided)]
    if not shared:
        assert any(type(d) is list for d in decided)


@pytest.mark.parametrize("shared", [False, True], ids=["one-policy", "workers"])
def test_the_counts_compiled_and_in_python_are_the_same(shared, tmp_path, monkeypatch):
    """`_counted` (every holder's weighing reads it) with a policy's lists, compiled and in Python,
    against itself without them: the same two dicts, in the same order, and the same terms, notes and
    turns file left behind, on random states."""
    from orchestrator.routing import llm_policies

    answered: list = []
    counting = _recording("counted", answered)
    for way in ("plain", "python", "compiled"):
        (tmp_path / way).mkdir()
    for seed in range(400):
        outcomes = []
        for way in ("plain", "python", "compiled"):
            backends, inflight, now, history, turns = _random_state(seed, tmp_path / way, shared)
            monkeypatch.setattr(llm_policies, "NATIVE", counting if way == "compiled" else None)
            ready = llm_policies.ReadyLists(turns) if way != "plain" else None
            both = llm_policies._counted(backends, inflight, now, history, note=True, ready=ready)
            outcomes.append(([list(d.items()) for d in both], *_left_behind(history, turns)))
        assert outcomes[0] == outcomes[1] == outcomes[2], f"seed {seed}"
    assert sum(d is not None for d in answered) > 100 and None in answered


@pytest.mark.parametrize("shared", [False, True], ids=["one-policy", "workers"])
def test_the_default_routes_alike_compiled_and_in_python(shared, tmp_path, monkeypatch):
    """The default policy whole, compiled passes on and off, on one run of 3000 requests: tenant
    prompts, chat turns and no prompt, engine snapshots every 0.1 s with waiting and full engines,
    counts that rise with each choice and fall at random. Each policy sees the same views and counts;
    every choice and its reason must be the same."""
    from orchestrator.dataplane.shared_stamps import SharedStamps
    from orchestrator.routing import llm_policies
    from orchestrator.routing.llm_policies import SharedTurns

    compiled = _compiled()
    rng = random.Random(7)
    clock = [NOW]
    backends = tuple(backend(str(i)) for i in range(4))
    policies = {}
    for way in ("compiled", "python"):
        turns = SharedTurns(SharedStamps.create(tmp_path / f"turns-{way}")) if shared else None
        policies[way] = PrefixAffinity(random.Random(1), clock=lambda: clock[0], turns=turns)
    prompts = [hints(t, f" question {q}") for t in range(6) for q in range(3)]
    prompts += [t for k in range(4) for t in _turns(300 + 200 * k, 120)] + [None] * 8
    inflight: dict[str, int] = {}
    next_scrape = NOW
    seen: dict[str, int] = {}  # reason -> choices
    for step in range(3000):
        clock[0] += rng.choice([0.0, 0.001, 0.004])
        if clock[0] >= next_scrape:  # every instance's engine, as the daemon's monitor publishes them
            next_scrape = clock[0] + 0.1
            for b in backends:
                held = inflight.get(b.instance_id, 0)
                b.engine.update(EngineSnapshot(at=clock[0], active=min(held + rng.randint(0, 2), 8),
                                               waiting=rng.choice([0, 0, 1]), max_active=8,
                                               kv_used=rng.randint(0, 100), kv_max=100, iteration=1.0,
                                               routed=held if shared else None))
        prompt = rng.choice(prompts)
        chosen = {}
        for way, policy in policies.items():
            monkeypatch.setattr(llm_policies, "NATIVE", compiled if way == "compiled" else None)
            chosen[way] = (policy.choose(backends, (), dict(inflight), prompt).instance_id, policy.last_reason)
        assert chosen["compiled"] == chosen["python"], f"step {step}"
        iid, reason = chosen["compiled"]
        seen[reason] = seen.get(reason, 0) + 1
        inflight[iid] = inflight.get(iid, 0) + 1
        for other in list(inflight):
            if rng.random() < 0.15:
                inflight[other] -= 1
                if not inflight[other]:
                    del inflight[other]
    # the run took every kind of choice: a holder, none held, no prompt, a holder passed over
    assert {"prefix", "prefix-miss", "no-prompt"} <= seen.keys(), seen
    assert seen.keys() & {"prefix-overloaded", "prefix-kv-wait", "prefix-full"}, seen
