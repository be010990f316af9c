"""The shared prefix index's compiled slots (dataplane/_prefix_slots.c) against its Python ones.

Both run the same operations on two files: after each, the files' bytes are the same and every
prompt matches alike. Operations come more than REWRITE_S apart (the Python slots skip a rewrite
within it, the compiled ones write every time; that difference is tested apart). Small tables,
so keys collide, neighbourhoods fill and evict, holders are replaced, and entries age out.
"""

from __future__ import annotations

import random

import pytest

from orchestrator.dataplane.shared_prefix import REWRITE_S, SharedPrefixIndex
from orchestrator.dataplane.shared_table import TableError
from orchestrator.routing.prefix_index import DEFAULT_CHUNK_CHARS, chunk_keys
from tests.fakes import ManualClock

pytestmark = pytest.mark.unit


def pair(tmp_path, slots: int, ttl_s: float = 600.0):
    clock = ManualClock()
    compiled = SharedPrefixIndex.create(tmp_path / "compiled", slots=slots, ttl_s=ttl_s, clock=clock)
    python = SharedPrefixIndex.create(tmp_path / "python", slots=slots, ttl_s=ttl_s, clock=clock, native=False)
    assert compiled.compiled, "orchestrator/dataplane/_prefix_slots.c is not built (scripts/bootstrap builds it)"
    assert not python.compiled
    return clock, compiled, python


def prompts(rng: random.Random, docs: int = 6) -> list[str]:
    """Prompts sharing leading documents to different depths, as tenants and chats do."""
    heads = ["".join(rng.choice("abcdefgh ") for _ in range(64 * DEFAULT_CHUNK_CHARS)) for _ in range(docs)]
    out = []
    for _ in range(40):
        head = rng.choice(heads)[:rng.randrange(1, 64) * DEFAULT_CHUNK_CHARS]
        out.append(head + "".join(rng.choice("xyz") for _ in range(rng.randrange(0, 3 * DEFAULT_CHUNK_CHARS))))
    return out


def odd_keys(rng: random.Random) -> list[bytes]:
    """Keys that are not 16-byte digests: short, long, all zero (stored under a stand-in key)."""
    return [rng.choice([bytes(16), bytes(3), b"\x00\x07", rng.randbytes(5), rng.randbytes(20), rng.randbytes(16)])
            for _ in range(rng.randrange(1, 4))]


@pytest.mark.parametrize("seed", range(6))
def test_compiled_slots_write_the_same_bytes_and_match_alike(tmp_path, seed):
    rng = random.Random(seed)
    clock, compiled, python = pair(tmp_path, slots=64 if seed % 2 else 512, ttl_s=30.0)
    texts = prompts(rng)
    chains = [chunk_keys(t) for t in texts] + [odd_keys(rng) for _ in range(6)]
    holders = nested = 0
    for step in range(400):
        clock.t += REWRITE_S * (1.5 + 20 * rng.random())
        op = rng.random()
        if op < 0.8:
            keys, iid = rng.choice(chains), str(rng.randrange(12))
            compiled.record(keys, iid)
            python.record(keys, iid)
        elif op < 0.85:
            iid = str(rng.randrange(12))
            compiled.forget_instance(iid)
            python.forget_instance(iid)
        else:
            clock.t += 31.0 * rng.random()  # some entries pass the TTL
        assert compiled._mm[:] == python._mm[:], f"step {step}"
        for keys in rng.sample(chains, 8) + [[], chains[0][:1]]:
            found = compiled.match_recency(keys)
            assert found == python.match_recency(keys), f"step {step}"
            holders += len(found[1])
            nested += len({depth for depth, _ in found[1].values()}) > 1
    # not vacuous: most matches found holders, often several at different depths (the bisection)
    assert holders > 2000 and nested > 200, (holders, nested)


def test_compiled_slots_write_every_time_and_refuse_a_closed_index(tmp_path):
    clock, compiled, python = pair(tmp_path, slots=1024)
    keys = chunk_keys("q" * 3 * DEFAULT_CHUNK_CHARS)
    compiled.record(keys, "1")
    clock.t += REWRITE_S / 2
    compiled.record(keys, "1")  # exact times: the compiled slots have no rewrite window
    assert compiled.match_recency(keys) == (3, {"1": (3, clock.t)})
    with pytest.raises(TableError):
        compiled.record(keys, "256")  # past the table's instances, as the Python slots refuse it
    with pytest.raises(IndexError):  # a position past the prompt's keys is refused, not read
        compiled._native.record(keys, (0, 3), 1, clock.t)
    slots = compiled._native
    compiled.close()  # the mapping is let go first (an exported buffer would refuse the close)
    with pytest.raises(ValueError, match="closed"):
        slots.match_recency(keys, (0, 1, 2), 0.0)
    python.close()


def test_a_module_built_for_another_slot_layout_is_left_for_the_python_slots(tmp_path, monkeypatch, caplog):
    from orchestrator.dataplane import shared_prefix
    monkeypatch.setattr(shared_prefix, "HOLDERS", 8)  # as a newer layout would have it
    index = SharedPrefixIndex.create(tmp_path / "p", slots=64)
    assert not index.compiled and "its slots run in Python" in caplog.text
    index.close()
