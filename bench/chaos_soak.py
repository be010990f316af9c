"""Chaos soak: the three tiers failing under load in one run, and what the clients saw.

    .venv/bin/python -m bench.chaos_soak [--seconds 60] [--seed 1] [--gap 3] [--faults worker,engine,...]
                                         [--proxy embedded|nginx]

Each fault has its own test (tests/test_e2e_faults.py, test_e2e_workers.py, test_e2e_live_restore.py);
this is their interactions: a worker killed while the daemon that supervises it is down, an engine
hang found by a daemon that adopted it mid-hang, a reload during a restart. One daemon (`up --gpus 0-3
--tp 2 --assume-gpus 4`: 2 instances x TP2, 2 data-plane workers, fast probes), closed-loop clients
on keep-alive connections (unary generates, native SSE streams, OpenAI chat streams), every answer
checked against the twin's own text (`vocab.generate_text`). Every `gap` seconds (jittered) one fault
drawn by the seed, without waiting for the last one's recovery:

  worker   kill -9 of a data-plane worker (`--proxy nginx`: of an NGINX worker, which its master replaces)
  engine   kill -9 of a tritonserver rank of a READY instance
  hang     SIGSTOP of a rank of a READY instance (left stopped: the daemon's detection must end it)
  daemon   kill -9 of the daemon and the same `up` 0.5 s later (live restore)
  reload   the worker count changed (2 <-> 3) with `reload`

A failed answer is *owed* to a fault where the promises allow it: it was on a connection the killed
worker held, or it was a stream whose answer had begun (a 200 head out: never retried) when an
engine fault hit, within the fault's window. With `--proxy nginx` also: a request on a connection an
NGINX worker held when a reload retired it (NGINX closes kept connections after their answer, and a
request written just then is lost: NGINX's own behaviour, docs/live-restore.md), and a 502 or
503 while no instance could answer (each not READY, or killed or hung and not back yet) or within
NGINX's passive check's period after (NGINX holds no request: docs/health.md; the readiness is
sampled from the control socket every 0.1 s). Every other failure, and every answer whose text is
wrong, is a finding. Then the run must settle (every instance READY, the workers wanted alive, no
process beyond the plan's), and after `down` nothing may be left.

Goals: 0 unexplained failures, 0 wrong texts, settled, 0 processes left.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from bench.common import bars, machine, table, write_result_md
from tests.harness import DEMO_REPO, Run, nginx_processes, tagged

sys.path.insert(0, str(DEMO_REPO / "tensorrt_llm" / "1"))
import vocab  # noqa: E402  (the twin's token function: what every answer must say)

FAULTS = ("worker", "engine", "hang", "daemon", "reload")
# Probes as the fault tests run them: a hang is found in ~1.5 s, not the default's ~15.
FAST = ("--probe-interval-s", "0.5", "--probe-timeout-s", "0.5", "--probe-failures", "3",
        "--canary-interval-s", "2", "--canary-idle-s", "1", "--canary-deadline-s", "2", "--stop-grace-s", "3")
# After an engine fault, how long a stream under way there may still end failed: the fault found
# (a kill at once, a hang after the probes' ~1.5 s; on a loaded 2-core box a few seconds more).
ENGINE_WINDOW_S = {"engine": 5.0, "hang": 10.0}
PROXIES = ("embedded", "nginx")
GENERATE = "/v2/models/ensemble/generate"
STREAM = "/v2/models/ensemble/generate_stream"
CHAT = "/v1/chat/completions"
KINDS = ("unary", "stream", "chat")  # the clients' kinds, in turn
STREAM_TOKENS = 16


def chat_prompt(content: str) -> str:
    """demo/tokenizer's chat template for one user turn (tests/test_openai_e2e.py's chat_prompt)."""
    return f"<|user|>\n{content}</s>\n<|assistant|>\n"


def _request(kind: str, prompt: str) -> tuple[str, bytes, str]:
    """(path, body, the text the twin must answer)."""
    if kind == "unary":
        return GENERATE, json.dumps({"text_input": prompt, "max_tokens": 4}).encode(), vocab.generate_text(prompt, 4)
    if kind == "stream":
        return (STREAM, json.dumps({"text_input": prompt, "max_tokens": STREAM_TOKENS, "stream": True}).encode(),
                vocab.generate_text(prompt, STREAM_TOKENS))
    return (CHAT, json.dumps({"model": "ensemble", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                              "stream": True}).encode(), vocab.generate_text(chat_prompt(prompt), 8))


def _lines(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    """The body's lines. Not `resp.readline()`: it reads through `peek`, which takes a chunked body
    cut short (the connection closed before its last chunk) for its end, so a stream cut by a
    killed worker read as an answer complete but short. `read1` raises IncompleteRead there."""
    buf = b""
    while True:
        data = resp.read1(65536)
        if not data:
            break
        *lines, buf = (buf + data).split(b"\n")
        yield from lines
    if buf:
        yield buf


def _read_answer(kind: str, resp: http.client.HTTPResponse) -> str:
    """The answer's text; an error event or a stream cut short raises ValueError."""
    if kind == "unary":
        return json.loads(resp.read())["text_output"]
    text, done = [], False
    for line in _lines(resp):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            raise ValueError(f"error event: {str(event['error'])[:120]}")
        if kind == "stream":
            text.append(event["text_output"])
        elif event.get("choices"):
            text.append(event["choices"][0]["delta"].get("content") or "")
    if kind == "chat" and not done:
        raise ValueError("no [DONE]")
    return "".join(text)


class Client(threading.Thread):
    """One user: one keep-alive connection at a time, requests in a closed loop, every answer kept
    as a record (kind, times, the connection's local port, whether its head came, ok, error)."""

    def __init__(self, port: int, kind: str, index: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port, self.kind, self.index, self.stop = port, kind, index, stop
        self.records: list[dict[str, Any]] = []

    def run(self) -> None:
        conn: http.client.HTTPConnection | None = None
        local = 0
        n = 0
        while not self.stop.is_set():
            n += 1
            path, body, want = _request(self.kind, f"{self.kind} {self.index} {n}")
            rec: dict[str, Any] = {"kind": self.kind, "t0": time.time(), "head": None, "ok": False}
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                    conn.connect()
                    local = conn.sock.getsockname()[1]
                rec["port"] = local
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                rec["head"] = time.time()
                rec["status"] = resp.status
                if resp.status != 200:
                    rec["error"] = f"{resp.status} {resp.read()[:160]!r}"
                    time.sleep(0.05)  # and backs off a little, as a real client does (not a tight loop)
                else:
                    got = _read_answer(self.kind, resp)
                    rec["ok"] = got == want
                    if not rec["ok"]:
                        rec["error"] = f"wrong text: {got[:60]!r} for {want[:60]!r}"
                        rec["wrong"] = True
                if resp.will_close:  # a draining worker's last answer: a new connection, a new port
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
                rec["error"] = repr(exc)[:200]
                if conn is not None:
                    conn.close()
                conn = None
            rec["t1"] = time.time()
            self.records.append(rec)
        if conn is not None:
            conn.close()


def _status(run: Run, timeout: float = 60.0) -> dict[str, Any]:
    """`status`, waiting while the daemon is being replaced (its socket not answering yet)."""
    deadline = time.monotonic() + timeout
    while True:
        out = run.cli("status", "--state-dir", str(run.state_dir), "--json")
        if out.returncode == 0:
            return json.loads(out.stdout)
        if time.monotonic() > deadline:
            raise AssertionError(f"status did not answer in {timeout} s: {out.stderr[-500:]}")
        time.sleep(0.2)


def _ports_held(pids: list[int], listen_port: int) -> dict[int, int]:
    """client port -> the pid of the data-plane process (of `pids`) holding that connection, now."""
    out = {}
    for pid in pids:
        try:
            for c in psutil.Process(pid).net_connections("tcp"):
                if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == listen_port and c.raddr:
                    out[c.raddr.port] = pid
        except psutil.Error:
            continue
    return out


def _dataplane_pids(st: dict[str, Any]) -> list[int]:
    """The processes serving clients: the live data-plane workers, or NGINX's workers."""
    proxy = st["proxies"][0]
    if proxy.get("kind") == "nginx":
        if not proxy.get("pid"):  # none yet (a daemon starting): psutil.Process(None) is this process
            return []
        try:
            return [c.pid for c in psutil.Process(proxy["pid"]).children()
                    if "shutting down" not in " ".join(c.cmdline())]
        except (psutil.Error, KeyError, TypeError, ValueError):
            return []
    return [w["pid"] for w in proxy.get("workers", []) if w.get("alive")]


def _ranks(instance: dict[str, Any]) -> list[psutil.Process]:
    out = []
    for pid in instance.get("pids", []):
        try:
            p = psutil.Process(pid)
            if p.name() == "tritonserver":
                out.append(p)
        except psutil.Error:
            continue
    return out


class Chaos:
    """Applies the faults: each returns what it did (None: no target now, e.g. no READY instance)."""

    def __init__(self, run: Run, tmp: Path, config: Path, rng: random.Random, proxy: str) -> None:
        self.run, self.tmp, self.config, self.rng, self.proxy = run, tmp, config, rng, proxy
        self.workers = 2
        self.daemons = 1

    def apply(self, kind: str) -> dict[str, Any] | None:
        st = _status(self.run)
        t = time.time()
        done = getattr(self, f"_{kind}")(st)
        return None if done is None else {"t": t, "kind": kind, **done}

    def _worker(self, st: dict[str, Any]) -> dict[str, Any] | None:
        pool = _dataplane_pids(st)
        if not pool:
            return None
        victim = self.rng.choice(pool)
        # who holds each client connection now: the kill owes what fails on the victim's
        ports = _ports_held(pool, self.run.listen_port)
        t = time.time()
        os.kill(victim, signal.SIGKILL)
        return {"t": t, "pid": victim, "ports": sorted(p for p, w in ports.items() if w == victim)}

    def _rank(self, st: dict[str, Any], sig: int) -> dict[str, Any] | None:
        ranks = [(i["id"], r) for i in st["instances"] if i["state"] == "READY" for r in _ranks(i)]
        if not ranks:
            return None
        iid, rank = self.rng.choice(ranks)
        rank.send_signal(sig)
        return {"instance": iid, "pid": rank.pid}

    def _engine(self, st: dict[str, Any]) -> dict[str, Any] | None:
        return self._rank(st, signal.SIGKILL)

    def _hang(self, st: dict[str, Any]) -> dict[str, Any] | None:
        return self._rank(st, signal.SIGSTOP)  # left stopped: the daemon's detection must end it

    def _daemon(self, st: dict[str, Any]) -> dict[str, Any]:
        pid = st["daemon"]["pid"]
        os.kill(pid, signal.SIGKILL)
        if self.run.proc is not None and self.run.proc.pid == pid:
            self.run.proc.wait(timeout=10)
        time.sleep(0.5)  # a supervisor's restart delay
        self.daemons += 1
        self.run.log_path = self.tmp / f"daemon-{self.daemons}.log"  # each daemon's own log
        self.run.start(wait_ready=False)
        return {"pid": pid, "new_pid": self.run.proc.pid if self.run.proc else None}

    def _reload(self, st: dict[str, Any]) -> dict[str, Any]:
        # the other worker count: a smaller pool drains the workers it stops
        self.workers = 5 - self.workers
        self.config.write_text(f'proxy-workers = "{self.workers}"\n')
        # NGINX retires every worker at a reload: what they held is owed (see the docstring), read
        # before and again once they are retiring (connections they took while the command ran)
        old = _dataplane_pids(st) if self.proxy == "nginx" else []
        held = set(_ports_held(old, self.run.listen_port))
        t = time.time()
        out = self.run.cli("reload", "--state-dir", str(self.run.state_dir))
        held |= set(_ports_held(old, self.run.listen_port))
        return {"t": t, "workers": self.workers, "rc": out.returncode, "ports": sorted(held),
                "error": out.stderr.strip()[-300:] if out.returncode else ""}


class Readiness(threading.Thread):
    """Which instances were READY when, read from the daemon's control socket every 0.1 s (in
    process: `status` as a command would cost a Python start each time); nothing while no daemon
    answers."""

    def __init__(self, orch: Run, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.orch, self.stop = orch, stop
        # (when, the READY instances, each instance's restarts: the daemon carries them over its restarts)
        self.samples: list[tuple[float, frozenset[str], dict[str, int]]] = []
        self.ids: set[str] = set()

    def run(self) -> None:
        from orchestrator.controlplane.control_socket import call_sync
        sock = self.orch.state_dir / "control.sock"
        while not self.stop.wait(0.1):
            try:
                code, st = call_sync(sock, "GET", "/status", timeout_s=2.0)
            except Exception:  # noqa: BLE001 - no daemon now (being replaced)
                continue
            if code == 200:
                self.ids |= {i["id"] for i in st["instances"]}
                self.samples.append((time.time(), frozenset(i["id"] for i in st["instances"] if i["state"] == "READY"),
                                     {i["id"]: i["restarts"] for i in st["instances"]}))

    def none_serving(self, t0: float, t1: float, faults: list[dict[str, Any]]) -> bool:
        """Whether at some sample from before `t0` to half a second after `t1` no instance could answer:
        each was not READY, or was killed or hung and not back since (a hung one reads READY until its
        detection). NGINX's passive check skips an instance that failed for FAIL_TIMEOUT_S: after every
        instance had failed it answered 502 ("no live upstreams") for up to 2 s after one was back
        (seed 21: 50 answers in 1.1 s), so that long counts too, before `t0` and after each return."""
        from orchestrator.nginx.proxy import FAIL_TIMEOUT_S
        # NGINX skips a failed instance for FAIL_TIMEOUT_S, however soon it is back
        out = [(f["instance"], f["t"], self._back(f["instance"], f["t"]) + FAIL_TIMEOUT_S + 0.5)
               for f in faults if f["kind"] in ENGINE_WINDOW_S]
        for t, ready, _ in self.samples:
            if t0 - 0.5 - FAIL_TIMEOUT_S <= t <= t1 + 0.5 and \
                    all(i not in ready or any(j == i and start <= t < end for j, start, end in out) for i in self.ids):
                return True
        return False

    def _back(self, iid: str, since: float) -> float:
        """When `iid` served again after a fault at `since`: its first READY sample after a restart
        (inf: not seen). Not its first READY one: a hung instance reads READY until its detection, and
        a daemon that adopts it mid-hang reads it READY again (samples come every 0.1 s when the
        daemon answers at once, seconds apart under load: a restart's not-READY moment is missed)."""
        before = [r.get(iid, 0) for t, _, r in self.samples if t <= since]
        restarts = before[-1] if before else 0
        for t, ready, r in self.samples:
            if t > since and iid in ready and r.get(iid, 0) > restarts:
                return t
        return math.inf


def owed(rec: dict[str, Any], faults: list[dict[str, Any]], readiness: Readiness | None = None) -> str | None:
    """The fault a failed answer is owed to (its kind), or None: a finding. `readiness`: NGINX mode's,
    where a 502 or 503 while no instance could answer is owed ("none serving")."""
    if readiness is not None and rec.get("status") in (502, 503) and \
            readiness.none_serving(rec["t0"], rec["t1"], faults):
        return "none serving"
    for f in faults:
        if rec.get("port") in f.get("ports", ()) and rec["t1"] >= f["t"]:
            return f["kind"]  # a killed worker's connection, or a retired NGINX worker's
        if f["kind"] in ENGINE_WINDOW_S and rec["kind"] != "unary" and rec.get("status") == 200 and \
                rec["t0"] <= f["t"] + ENGINE_WINDOW_S[f["kind"]] and rec["t1"] >= f["t"]:
            return f["kind"]
    return None


def settle(run: Run, timeout: float) -> tuple[dict[str, Any], float]:
    """Wait for the end state; (status, seconds it took)."""
    t = time.monotonic()

    def settled(st: dict[str, Any]) -> bool:
        pool = st["proxies"][0]
        if pool.get("kind") == "nginx":  # and its side workers
            pool, running = pool.get("side") or {}, pool["state"] == "running"
            if not pool:
                return st["ready"] == st["total"] and running
        else:
            running = True
        return st["ready"] == st["total"] and running and \
            pool["workers_alive"] == pool["workers_wanted"] == len(pool["workers"])
    deadline = t + timeout
    while True:
        st = _status(run)
        if settled(st):
            return st, time.monotonic() - t
        if time.monotonic() > deadline:
            raise AssertionError(f"not settled in {timeout} s: {json.dumps(st)[:1500]}")
        time.sleep(0.3)


def _plan_processes(run: Run, st: dict[str, Any]) -> dict[str, Any]:
    """The processes of the state dir beyond what the settled status accounts for (leaks while running)."""
    listed = {pid for i in st["instances"] for pid in i.get("pids", [])}
    pools = [q for p in st["proxies"] for q in (p, p.get("side") or {})]  # NGINX mode: its side workers
    listed |= {w["pid"] for p in pools for w in p.get("workers", []) if w.get("pid")}
    listed |= {p["pid"] for p in st["proxies"] if p.get("kind") == "nginx" and p.get("pid")}
    listed.add(st["daemon"]["pid"])
    extra, servers = [], 0
    for p in tagged(run.state_dir) + nginx_processes(run.state_dir):
        try:
            servers += p.name() == "tritonserver"
            # a child of a listed process (a rank's Python stubs, an mpirun's daemon) is accounted for
            if p.pid in listed or any(a.pid in listed for a in p.parents()):
                continue
            extra.append(f"{p.pid} {p.name()} {' '.join(p.cmdline()[:3])}")
        except psutil.Error:
            continue
    return {"unlisted": extra, "tritonservers": servers}


def soak(seconds: float, seed: int, gap: float, faults: tuple[str, ...], clients: int,
         proxy: str = "embedded") -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    config = tmp / "orch.toml"
    config.write_text('proxy-workers = "2"\n')
    run = Run(tmp, gpus="0-3", tp=2, assume_gpus=4, proxy=proxy, extra=("--config", str(config), *FAST),
              env_extra={"DEMO_TOKEN_DELAY_MS": "5"})
    rng = random.Random(seed)
    stop = threading.Event()
    users: list[Client] = []
    applied: list[dict[str, Any]] = []
    out: dict[str, Any] = {"seconds": seconds, "seed": seed, "gap_s": gap, "faults_drawn_from": list(faults),
                           "clients": clients, "proxy": proxy}
    try:
        run.start(timeout=120)
        users = [Client(run.listen_port, KINDS[i % len(KINDS)], i, stop) for i in range(clients)]
        for u in users:
            u.start()
        readiness = Readiness(run, stop) if proxy == "nginx" else None
        if readiness is not None:
            readiness.start()
        chaos = Chaos(run, tmp, config, rng, proxy)
        t_start = time.time()
        time.sleep(2.0)
        while time.time() - t_start < seconds:
            kind = rng.choice(faults)
            done = chaos.apply(kind)
            if done is not None:
                done["at_s"] = round(done["t"] - t_start, 2)
                applied.append(done)
                shown = {k: v for k, v in done.items() if k in ('pid', 'instance', 'workers', 'rc')}
                print(f"  {done['at_s']:6.2f} s  {kind:7s} {shown}", flush=True)
            time.sleep(gap * rng.uniform(0.5, 1.5))
        t_faults_end = time.time()
        st, settle_s = settle(run, 120.0)
        time.sleep(2.0)  # and answers after the end state
        stop.set()
        for u in users:
            u.join(90)
        if readiness is not None:
            readiness.join(10)
        records = [r for u in users for r in u.records]
        failed = [r for r in records if not r["ok"]]
        by_owner: dict[str, int] = {}
        findings, owed_list = [], []
        for r in failed:
            owner = owed(r, applied, readiness) if not r.get("wrong") else None
            brief = {**{k: r.get(k) for k in ("kind", "port", "error")}, "t0_s": round(r["t0"] - t_start, 3),
                     "t1_s": round(r["t1"] - t_start, 3), "head": r["head"] is not None}
            if owner is None:
                findings.append(brief)
            else:
                by_owner[owner] = by_owner.get(owner, 0) + 1
                owed_list.append({**brief, "owed_to": owner})
        for f in applied:
            if f["kind"] == "reload" and f["rc"] != 0:
                findings.append({"kind": "reload", "error": f["error"], "t0_s": f["at_s"]})  # refused or failed
        counts = {k: sum(1 for r in records if r["kind"] == k) for k in KINDS}
        out.update({
            "answers": len(records), "by_kind": counts, "failed": len(failed), "owed": by_owner,
            "findings": findings[:50], "unexplained": len(findings), "owed_failures": owed_list[:100],
            "wrong_texts": sum(1 for r in failed if r.get("wrong")),
            "faults": [{k: v for k, v in f.items() if k not in ("t", "ports")} for f in applied],
            "fault_counts": {k: sum(1 for f in applied if f["kind"] == k) for k in faults},
            "settle_s": round(settle_s, 2), "restarts": {i["id"]: i["restarts"] for i in st["instances"]},
            "daemons": chaos.daemons, "after_faults_s": round(time.time() - t_faults_end, 1),
            "processes": _plan_processes(run, st),
        })
    finally:
        stop.set()
        out["leaked_pids"] = run.close()
        out["logs"] = str(tmp)
    return out


def plot(result: dict[str, Any], plt: Any) -> Any:
    """Per fault kind: how many were applied, and the failed answers owed to them."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    kinds = list(result["fault_counts"])
    bars(ax, kinds, {"faults applied": [result["fault_counts"][k] for k in kinds],
                     "failed answers owed to them": [result["owed"].get(k, 0) for k in kinds]},
         ylabel="count", title=f"chaos soak, seed {result['seed']}: {result['answers']} answers, {result['failed']} "
                               f"failed, {result['unexplained']} unexplained, {len(result['leaked_pids'])} left")
    fig.tight_layout()
    return fig


def report(result: dict[str, Any]) -> str:
    lines = [table([{"answers": result["answers"], **result["by_kind"], "failed": result["failed"],
                     "owed": ", ".join(f"{k} {v}" for k, v in result["owed"].items()) or "-",
                     "unexplained": result["unexplained"], "wrong": result["wrong_texts"],
                     "settle_s": result["settle_s"], "left": len(result["leaked_pids"])}],
                   ["answers", *KINDS, "failed", "owed", "unexplained", "wrong", "settle_s", "left"]),
             "", f"seed {result['seed']}, {result.get('proxy', 'embedded')} data plane, "
                 f"{result['seconds']:g} s of faults "
                 f"every ~{result['gap_s']:g} s, "
                 f"{result['clients']} clients; faults applied: "
                 + ", ".join(f"{k} {v}" for k, v in result["fault_counts"].items())
                 + f"; daemons: {result['daemons']}; restarts counted at the end: {result['restarts']}; "
                   f"processes beyond the plan while settled: {result['processes']['unlisted'] or 'none'}"]
    lines += [f"  finding: {f}" for f in result["findings"][:20]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long faults are applied")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gap", type=float, default=3.0, help="mean seconds between faults")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--proxy", choices=PROXIES, default="embedded", help="the data plane: workers or a managed NGINX")
    ap.add_argument("--out", type=Path, default=None, help="write the result here, not bench/results/")
    args = ap.parse_args()
    faults = tuple(args.faults.split(","))
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        ap.error(f"--faults: {bad[0]!r} is not one of {', '.join(FAULTS)}")
    result = {"bench": "chaos_soak", "machine": machine(),
              **soak(args.seconds, args.seed, args.gap, faults, args.clients, args.proxy)}
    write_result_md("chaos_soak", result, plot, args.out, __doc__.split("\n\n")[0], report(result))
    ok = result["unexplained"] == 0 and result["wrong_texts"] == 0 and not result["leaked_pids"] and \
        not result["processes"]["unlisted"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
