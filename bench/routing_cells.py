"""The routing matrix of issue 24, one definition for the simulator (routing_sim.py) and the
real twin (routing_bench.py): engine shapes x KV room x workloads x loads.

Cells (every cell: 2 instances, twin engine, 64-token blocks, decode 20 ms per iteration,
prefill 0.1 ms per uncached prompt token, KV reuse on, guaranteed_no_evict):
    slots   8 or 64 in-flight batch slots per instance
    room    KV cache room for 1.5 or 4 tenant prefixes (2048 tokens each) beyond what the
            slots' own questions and answers take (SLOT_TOKENS each): the paged cache holds
            room * 2048 + slots * SLOT_TOKENS tokens per instance

Workloads (the twin's tokenizer is byte level: one character = one token):
    uniform  tenants = ceil(2 * room) (as many prefixes as the two caches hold together, more
             than one holds), each a 2048-token system prompt, tenant uniform at random; a
             40..120-token question; max_tokens 8..32
    zipf     the same tenants, tenant k drawn with weight 1 / (k + 1) ** ZIPF_S
    chat     multi-turn conversations: a 256-token system prompt every conversation shares, a
             512..1024-token opening (a document) of its own, then 4..6 turns; each turn's
             prompt is the previous prompt + the answer + a 40..160-token message; answers
             16..48 tokens; the next turn THINK_S (exponential mean) after the answer in
             open loop, at once in closed loop
    unique   no shared prefix: every prompt unique from its first byte, 32..1024 tokens,
             max_tokens 1..64 (routing_bench's old workload B)
    mixed    mixed long and short, no sharing: 80% 32..256 tokens, 20% 1024..3072 tokens
             (long ones fit every cell's cache), max_tokens 8..64

Loads: open loop (Poisson session starts) at RATE_FRACTIONS of the cell's nominal capacity
(`capacity`: what the two engines serve when every cacheable token is cached), and closed
loop at 2 x slots concurrent users (every slot busy plus a queue as deep).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from bench.common import pct

PREFIX_TOKENS = 2048
BLOCK = 64
DECODE_MS = 20.0
PREFILL_MS = 0.1
INSTANCES = 2
SLOT_TOKENS = 192  # one slot's question + answer, rounded up to blocks (3 x 64)
ZIPF_S = 1.2
THINK_S = 1.0
RATE_FRACTIONS = (0.3, 0.6, 0.9)
WORKLOADS = ("uniform", "zipf", "chat", "unique", "mixed")
TENANT_WORKLOADS = ("uniform", "zipf")  # tenants' shared system prompts (the half goal's cells)
# Issue 24's bounds against the best of least-outstanding and NGINX (no worse than 3% in TTFT p90
# and tokens/s), and in the tenant cells against NGINX (half its TTFT p90, 1.3 x its tokens/s).
NO_WORSE_TTFT, NO_WORSE_TOK_S = 1.03, 0.97
HALF_TTFT, GAIN_TOK_S = 0.5, 1.3
SHAPES = (8, 64)
ROOMS = (1.5, 4.0)
TARGETS = ("cost-model", "prefix-affinity", "least-outstanding", "round-robin", "nginx")

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu policy tenant invoice ledger refund account billing support clause").split()


def text(rng: random.Random, n: int) -> str:
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n].ljust(n)


@dataclass(frozen=True)
class Cell:
    slots: int
    room: float
    workload: str
    load: str  # "r0", "r1", "r2" (open loop at RATE_FRACTIONS) or "closed"

    @property
    def name(self) -> str:
        return f"s{self.slots}/room{self.room:g}/{self.workload}/{self.load}"

    @property
    def kv_tokens(self) -> int:
        return int(self.room * PREFIX_TOKENS) // BLOCK * BLOCK + self.slots * SLOT_TOKENS

    @property
    def tenants(self) -> int:
        return math.ceil(INSTANCES * self.room)

    @property
    def concurrency(self) -> int:
        return 2 * self.slots

    def rate(self) -> float | None:
        if self.load == "closed":
            return None
        return round(RATE_FRACTIONS[int(self.load[1:])] * capacity(self), 2)


def cells(shapes=SHAPES, rooms=ROOMS, workloads=WORKLOADS, loads=("r0", "r1", "r2", "closed")) -> list[Cell]:
    return [Cell(s, r, w, ld) for s in shapes for r in rooms for w in workloads for ld in loads]


# --- sessions -----------------------------------------------------------------------------
class Session:
    """One user's run of turns. `first()` gives the first request, `next(answer)` the one after
    it (None: done). A request is (prompt, max_tokens)."""

    def __init__(self, turns: list[tuple[str, int]] | None = None) -> None:
        self._turns = turns or []
        self._i = 0

    def first(self) -> tuple[str, int]:
        self._i = 1
        return self._turns[0]

    def next(self, answer: str) -> tuple[str, int] | None:
        if self._i >= len(self._turns):
            return None
        self._i += 1
        return self._turns[self._i - 1]

    think_s = 0.0


class Chat(Session):
    def __init__(self, system: str, opening: str, turns: int, rng: random.Random, tag: str) -> None:
        super().__init__()
        self._rng = rng
        self._left = turns
        self._prompt = f"{system}\n[{tag}] User: {opening}\nAssistant:"
        self.think_s = THINK_S

    def first(self) -> tuple[str, int]:
        self._left -= 1
        return self._prompt, self._rng.randint(16, 48)

    def next(self, answer: str) -> tuple[str, int] | None:
        if self._left <= 0:
            return None
        self._left -= 1
        self._prompt += answer + "\nUser: " + text(self._rng, self._rng.randint(40, 160)) + "\nAssistant:"
        return self._prompt, self._rng.randint(16, 48)


def tenant_prefixes(salt: str, tenants: int) -> list[str]:
    out = []
    for t in range(tenants):
        rng = random.Random(f"{salt}/tenant{t}")
        head = f"[{salt} tenant {t}] You are the assistant of tenant {t}. Rules: "
        out.append((head + text(rng, PREFIX_TOKENS))[:PREFIX_TOKENS])
    return out


def sessions(cell: Cell, salt: str, seed: str) -> Iterator[Session]:
    """An endless stream of sessions of the cell's workload: prompts new for `salt` (each target
    visit its own, so caches left by another visit do not help), draws from `seed` (the same for
    every target of a round: same lengths, tenants, max_tokens)."""
    rng = random.Random(f"{seed}/{cell.workload}")
    w = cell.workload
    n = 0
    if w in TENANT_WORKLOADS:
        prefixes = tenant_prefixes(salt, cell.tenants)
        weights = [1.0 / (k + 1) ** (ZIPF_S if w == "zipf" else 0.0) for k in range(cell.tenants)]
        while True:
            t = rng.choices(range(cell.tenants), weights)[0]
            q = f" Question {n}: " + text(rng, rng.randint(40, 120)) + "?"
            yield Session([(prefixes[t] + q, rng.randint(8, 32))])
            n += 1
    elif w == "chat":
        system = ("[" + salt + "] You are a careful assistant. " + text(random.Random(salt), 256))[:256]
        while True:
            opening = text(rng, rng.randint(512, 1024))
            yield Chat(system, opening, rng.randint(4, 6), random.Random(f"{seed}/chat{n}"), f"{salt}-{n}")
            n += 1
    elif w == "unique":
        while True:
            length = rng.randint(32, 1024)
            yield Session([((f"{n:06d}:{salt} " + text(rng, length))[:length], rng.randint(1, 64))])
            n += 1
    elif w == "mixed":
        while True:
            length = rng.randint(1024, 3072) if rng.random() < 0.2 else rng.randint(32, 256)
            yield Session([((f"{n:06d}:{salt} " + text(rng, length))[:length], rng.randint(8, 64))])
            n += 1
    else:
        raise ValueError(f"workload {w!r}: one of {', '.join(WORKLOADS)}")


# --- nominal capacity -------------------------------------------------------------------------
# Mean per request: (prompt tokens that must be prefilled even when everything cacheable is
# cached, output tokens, KV tokens a running request holds apart from shared prefixes).
_MEANS = {
    "uniform": (80 + 14, 20, 80 + 14 + 20),
    "zipf": (80 + 14, 20, 80 + 14 + 20),
    # the caches hold only a few conversations' histories (~1600 tokens on average over the
    # turns) beside the slots: the nominal capacity counts every turn's prompt as computed
    "chat": (1600, 32, 1650),
    "unique": (528, 32.5, 528 + 32.5),
    "mixed": (0.8 * 144 + 0.2 * 2048, 36, 0.8 * 144 + 0.2 * 2048 + 36),
}


def capacity(cell: Cell) -> float:
    """Requests/s the two engines serve when every cacheable token is cached (the cache-oracle
    bound the rates are fractions of): the batch is the slots, or what the KV cache holds."""
    prefill, out, held = _MEANS[cell.workload]
    # Tenants' prefixes split over the instances, each instance's resident while its tenants run.
    shared = PREFIX_TOKENS * math.ceil(cell.tenants / INSTANCES) if cell.workload in TENANT_WORKLOADS else 0
    batch = max(1.0, min(cell.slots, (cell.kv_tokens - shared) / held))
    per_request_s = (PREFILL_MS * prefill + out * DECODE_MS / batch) / 1000.0
    return INSTANCES / per_request_s


def default_policy() -> str:
    """The routing policy `up` runs when none is named: the one issue 24's goals judge."""
    from orchestrator.config import Settings
    return next(f.default for f in dataclasses.fields(Settings) if f.name == "lb_policy")


BASELINES = ("least-outstanding", "nginx")  # issue 24's goal: the default against the best of these


def verdicts_field(target: str) -> str:
    """Where a routing_sim run writes `target`'s verdicts: `verdicts` for the default as one
    policy, `verdicts_<target>` beside it for the others (`prefix-affinity@4`:
    `verdicts_prefix_affinity_at_4`)."""
    if target == default_policy():
        return "verdicts"
    return f"verdicts_{target.replace('-', '_').replace('@', '_at_')}"


# A row's TTFTs (ms) per seed, where the simulator kept them: the seeds are paired across targets
# (a seed is the same arrivals and prompts for every target), so the verdict can say how far the
# seeds' spread alone moves it.
SEED_TTFTS = "_ttft_ms_by_seed"
RESAMPLES = 400


def ratio_interval(default: list[list[float]], baselines: list[list[list[float]]],
                   rng: random.Random, resamples: int = RESAMPLES) -> tuple[float, float]:
    """90% bootstrap interval of TTFT p90 (default / the best baseline), seeds resampled with
    replacement, the same seeds for every target (paired): each resample pools the drawn seeds'
    requests, as the point estimate pools them all."""
    def pooled(pick: Sequence[int]) -> float:
        d = pct([x for i in pick for x in default[i]], 90)
        best = min(pct([x for i in pick for x in b[i]], 90) for b in baselines)
        return d / best if d is not None and best else math.inf

    return _seed_bootstrap(len(default), pooled, rng, resamples)


def _seed_bootstrap(k: int, ratio: Callable[[Sequence[int]], float], rng: random.Random,
                    resamples: int) -> tuple[float, float]:
    """The 90% interval of `ratio` over `resamples` draws of k seeds with replacement."""
    ratios = sorted(ratio([rng.randrange(k) for _ in range(k)]) for _ in range(resamples))
    return ratios[int(0.05 * resamples)], ratios[int(0.95 * resamples) - 1]


# What a written routing_sim row keeps of its seeds: each seed's TTFT p90 (ms).
SEED_P90S = "ttft_p90_by_seed"


def seed_p90_ratio(default: list[float], baselines: list[list[float]], pick: Sequence[int]) -> float:
    """The geometric mean of the picked seeds' TTFT p90s (default) over the lowest such mean among
    the baselines: every seed weighs alike (the pooled p90 leans towards the seed with the longest
    tail, which in an overloaded cell is one seed's queue)."""
    d = sum(math.log(default[i]) for i in pick)
    best = min(sum(math.log(b[i]) for i in pick) for b in baselines)
    return math.exp((d - best) / len(pick))


def seed_p90_interval(default: list[float], baselines: list[list[float]], rng: random.Random,
                      resamples: int = 2000) -> tuple[float, float]:
    """`ratio_interval` for rows read back from a written run, which keep each seed's TTFT p90
    only: seeds resampled with replacement (paired), each resample's ratio `seed_p90_ratio`."""
    return _seed_bootstrap(len(default), lambda pick: seed_p90_ratio(default, baselines, pick), rng, resamples)


def verdicts(rows: list[dict[str, Any]], default: str | None = None) -> list[dict[str, Any]]:
    """Per cell: `default` (the product's default policy unless named) against the best of
    least-outstanding and nginx (issue 24's goals). Where the rows carry their TTFTs per seed
    (routing_sim), also the 90% interval of the TTFT ratio over the seeds (`ratio_interval`; rows
    read back from a written run: `seed_p90_interval`, around `ttft_p90_vs_best_seeds_gm`) and
    whether a miss is beyond that noise (`beyond_noise`: even the interval's low end above 1.03,
    or tokens/s short by more than 3%, which has no interval and moves far less between seeds)."""
    default = default or default_policy()
    by_cell: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_cell.setdefault(r["cell"], {})[r["target"]] = r
    out = []
    for name, t in by_cell.items():
        if default not in t or "nginx" not in t:
            continue
        d, ngx = t[default], t["nginx"]
        base = [t[k] for k in BASELINES if k in t]
        best_ttft = min(b["ttft_p90_ms"] for b in base)
        best_tps = max(b["out_tok_s"] for b in base)
        row = {"cell": name, "ttft_p90_vs_best": round(d["ttft_p90_ms"] / best_ttft, 3),
               "tok_s_vs_best": round(d["out_tok_s"] / best_tps, 3),
               "ttft_p90_vs_nginx": round(d["ttft_p90_ms"] / ngx["ttft_p90_ms"], 3),
               "tok_s_vs_nginx": round(d["out_tok_s"] / ngx["out_tok_s"], 3)}
        row["no_worse"] = row["ttft_p90_vs_best"] <= NO_WORSE_TTFT and row["tok_s_vs_best"] >= NO_WORSE_TOK_S
        lo = None
        if SEED_TTFTS in d and all(SEED_TTFTS in b for b in base) and len(d[SEED_TTFTS]) > 1:
            lo, hi = ratio_interval(d[SEED_TTFTS], [b[SEED_TTFTS] for b in base], random.Random(name))
        elif all(len(x.get(SEED_P90S) or ()) > 1 and all(x[SEED_P90S]) for x in (d, *base)):
            p90s = d[SEED_P90S], [b[SEED_P90S] for b in base]
            row["ttft_p90_vs_best_seeds_gm"] = round(seed_p90_ratio(*p90s, range(len(p90s[0]))), 3)
            lo, hi = seed_p90_interval(*p90s, random.Random(name))
        if lo is not None:
            row["ttft_p90_vs_best_ci90"] = [round(lo, 3), round(hi, 3)]
            row["beyond_noise"] = not row["no_worse"] and (lo > NO_WORSE_TTFT or row["tok_s_vs_best"] < NO_WORSE_TOK_S)
        out.append(row)
    return out
