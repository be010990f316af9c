"""Issue 5 end to end: sd_notify, rolling restart under load, logs, status, up --detach.

Real daemon, real mpirun + tritonserver (the demo model), driven only through the
public CLI, signals and the load-balanced endpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from orchestrator.logs import line_rank
from tests.harness import DEMO_REPO, REPO, tagged, transitions

pytestmark = pytest.mark.e2e

GEN_PATH = "/v2/models/ensemble/generate"


def gen_body(text: str = "hello", max_tokens: int = 2) -> bytes:
    return json.dumps({"text_input": text, "max_tokens": max_tokens, "bad_words": "", "stop_words": ""}).encode()


def post(url: str, body: bytes | None = None, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body or gen_body(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read())


def get_code(url: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def pids_of(status: dict) -> dict[str, set[int]]:
    return {i["id"]: set(i["pids"]) for i in status["instances"]}


# --- 1. sd_notify -------------------------------------------------------------------------
class NotifyListener:
    """A real $NOTIFY_SOCKET: every datagram with its arrival time.

    `on_ready` runs in the receiving thread the moment READY=1 arrives, before the
    next datagram is read, so it sees the world exactly as systemd would.
    """

    def __init__(self, path: Path, on_ready=None):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # the kernel names each sender
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, list[str]]] = []
        self.senders: set[int] = set()
        self.on_ready = on_ready
        self.ready_result = None
        self.ready_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data, anc, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(12))
            except socket.timeout:
                continue
            for level, kind, cred in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    self.senders.add(int.from_bytes(cred[:4], sys.byteorder))
            lines = data.decode().splitlines()
            self.messages.append((time.monotonic(), lines))
            if "READY=1" in lines and self.on_ready is not None and self.ready_result is None:
                try:
                    self.ready_result = self.on_ready()
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    self.ready_error = exc
                    self.ready_result = "error"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def times(self, key: str) -> list[float]:
        return [t for t, lines in self.messages if any(ln == key or ln.startswith(key) for ln in lines)]

    def values(self, prefix: str) -> list[str]:
        return [ln[len(prefix):] for _, lines in self.messages for ln in lines if ln.startswith(prefix)]


def notify_path(tmp_path: Path) -> Path:
    path = tmp_path / "notify.sock"
    if len(str(path)) < 100:
        return path
    return Path(tempfile.mkdtemp(prefix="orch-notify-", dir="/tmp")) / "n.sock"  # sun_path is 108 bytes


def _start_with_notify(orch_run, tmp_path: Path, extra=()):
    path = notify_path(tmp_path)
    started = time.monotonic()
    run = orch_run(extra=extra, env_extra={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"})
    run.env.pop("WATCHDOG_PID", None)  # the notifier accepts a missing WATCHDOG_PID (else: must be its pid)

    def on_ready():
        # Runs the instant READY=1 is received: the endpoint must already answer.
        health = get_code(run.url("/v2/health/ready"))
        code, body = post(run.url(GEN_PATH))
        return health, code, body

    listener = NotifyListener(path, on_ready)
    run.start(wait_ready=False)
    return run, listener, started


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not seen within {timeout}s")


def test_sd_notify_ready_watchdog_status_stopping(orch_run, tmp_path):
    run, listener, started = _start_with_notify(orch_run, tmp_path)
    try:
        _wait(lambda: listener.ready_result is not None, 120, "READY=1")
        assert listener.ready_error is None, f"endpoint check at READY=1 failed: {listener.ready_error!r}"
        health, code, body = listener.ready_result
        assert health == 200, "READY=1 was sent before the endpoint answered /v2/health/ready"
        assert code == 200 and body["text_output"]
        t_ready = listener.times("READY=1")[0]
        assert run.status()["ready"] == 2
        daemon_pid = run.status()["daemon"]["pid"]
        time.sleep(3.0)  # ~6 watchdog periods while serving
        out = run.down()
        assert out.returncode == 0, out.stderr
        assert run.proc.wait(timeout=30) == 0
        _wait(lambda: listener.times("STOPPING=1"), 5, "STOPPING=1")
        time.sleep(0.3)
    finally:
        listener.close()

    msgs = listener.messages
    assert msgs, "no datagram at all"
    # READY=1 exactly once, with the final STATUS in the same datagram.
    assert len(listener.times("READY=1")) == 1, msgs
    ready_msg = next(lines for _, lines in msgs if "READY=1" in lines)
    assert any(ln.startswith("STATUS=") and "2/2 instances ready" in ln for ln in ready_msg), ready_msg
    statuses = listener.values("STATUS=")
    assert any("0/2 instances ready" in s for s in statuses), statuses  # progress before READY
    assert any("2/2 instances ready" in s for s in statuses)

    # Watchdog: repeatedly, every ~0.5 s (WATCHDOG_USEC=1 s), from start to stop.
    t_stop = listener.times("STOPPING=1")[0]
    assert t_stop > t_ready
    pings = listener.times("WATCHDOG=1")
    serving = [t for t in pings if t_ready + 0.5 < t < t_stop]  # skip the on_ready HTTP calls' delay
    assert len(serving) >= 4, (len(pings), serving)
    gaps = [b - a for a, b in zip(serving, serving[1:])]
    assert max(gaps) < 1.0, f"watchdog gap {max(gaps):.2f}s >= WATCHDOG_USEC: {gaps}"
    assert 0.3 < sum(gaps) / len(gaps) < 0.75, gaps
    assert not [t for t in pings if t > t_stop + 0.05], "WATCHDOG=1 after STOPPING=1"

    # EXTEND_TIMEOUT_USEC keeps systemd's start timeout away while loading: only before READY.
    extends = listener.times("EXTEND_TIMEOUT_USEC=")
    startup_s = t_ready - msgs[0][0]
    if startup_s > 0.5:  # slower than one watchdog interval: at least one extension was due
        assert extends and extends[0] < t_ready, (startup_s, msgs[:5])
    assert all(t <= t_ready for t in extends), "EXTEND_TIMEOUT_USEC after READY=1"
    assert all(int(v) >= 30_000_000 for v in listener.values("EXTEND_TIMEOUT_USEC="))
    # Only the daemon itself speaks (the unit has NotifyAccess=main: systemd drops the rest).
    assert listener.senders == {daemon_pid}, (listener.senders, daemon_pid)
    assert tagged(run.state_dir) == []
    assert started < msgs[0][0]


def test_sd_notify_ready_min_one(orch_run, tmp_path):
    run, listener, _ = _start_with_notify(orch_run, tmp_path, extra=("--ready-min", "1"))
    try:
        _wait(lambda: listener.ready_result is not None, 120, "READY=1")
        assert listener.ready_error is None, repr(listener.ready_error)
        health, code, _ = listener.ready_result
        assert (health, code) == (200, 200)
        run.wait_ready(60)  # the second instance keeps coming up after READY=1
        _wait(lambda: any("2/2 instances ready" in s for s in listener.values("STATUS=")), 10, "2/2 STATUS")
    finally:
        listener.close()
    ready_msg = next(lines for _, lines in listener.messages if "READY=1" in lines)
    assert any("1/2 instances ready" in ln for ln in ready_msg), ready_msg
    assert len(listener.times("READY=1")) == 1


# --- 2. rolling restart under load -------------------------------------------------------
class Load:
    """Non-streaming generates through the endpoint, back to back, until stopped."""

    def __init__(self, url: str, threads: int = 2):
        self.url = url
        self.ok = 0
        self.done_at: list[float] = []  # wall clock, comparable with the daemon log's stamps
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(n,), daemon=True) for n in range(threads)]
        for t in self._threads:
            t.start()

    def _loop(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                code, body = post(self.url, gen_body(f"load {n} {i}", 2), timeout=30)
                if code == 200 and body.get("text_output"):
                    self.ok += 1
                    self.done_at.append(time.time())
                else:
                    self.failed.append(f"{code} {body}")
            except Exception as exc:  # noqa: BLE001
                detail = exc.read().decode(errors="replace")[:300] if isinstance(exc, urllib.error.HTTPError) else ""
                self.failed.append(f"{time.strftime('%H:%M:%S')} {exc!r} {detail}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(40)


class StatePoller:
    """Polls the daemon's control socket (in-process: a CLI call per sample is too slow)."""

    def __init__(self, state_dir: Path):
        from orchestrator.controlplane.control_socket import call_sync
        self._call = call_sync
        self.sock = state_dir / "control.sock"
        self.samples: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                _, status = self._call(self.sock, "GET", "/status", 5)
                self.samples.append({i["id"]: i["state"] for i in status["instances"]})
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _never_both_down_in_log(log_text: str, since: float) -> list[tuple]:
    """Replays the daemon log's state transitions: moments when no instance was READY."""
    state = {"0": "READY", "1": "READY"}
    bad = []
    for stamp, inst, old, new, reason in transitions(log_text):
        if stamp < since:
            continue
        state[inst] = new
        if all(s != "READY" for s in state.values()):
            bad.append((stamp, inst, old, new, reason))
    return bad


def _rolling(run, trigger, expect_restarts: int, load: "Load") -> None:
    before = run.status()
    old = pids_of(before)
    since = time.time() - 1  # log stamps have ms resolution; the log is the daemon's own clock
    poller = StatePoller(run.state_dir)
    try:
        trigger()
        final = run.wait_for(
            lambda s: all(i["restarts"] == expect_restarts and i["state"] == "READY" for i in s["instances"])
            and not s["daemon"]["rolling_restart"], timeout=120, what=f"rolling restart #{expect_restarts}")
    finally:
        poller.stop()
    new = pids_of(final)
    for inst_id, pids in new.items():
        assert pids and not (pids & old[inst_id]), f"instance {inst_id} kept pids {pids & old[inst_id]}"
    assert not any(alive(p) for ps in old.values() for p in ps)
    # One at a time: never both out of READY, by sampling and by the daemon's own log.
    both_down = [s for s in poller.samples if all(v != "READY" for v in s.values())]
    assert poller.samples and not both_down, both_down[:5]
    assert any(any(v != "READY" for v in s.values()) for s in poller.samples), "no restart was sampled"
    assert _never_both_down_in_log(run.daemon_log(), since) == []
    # Instance 0 went first and was READY again before instance 1 left.
    seq = [(inst, new) for stamp, inst, _, new, _ in transitions(run.daemon_log()) if stamp >= since]
    stops = [inst for inst, st in seq if st == "STOPPING"]
    assert stops == ["0", "1"], seq
    # The load really ran through both restarts: answers while each instance was out.
    log = [(stamp, inst, new) for stamp, inst, _, new, _ in transitions(run.daemon_log()) if stamp >= since]
    for inst_id in ("0", "1"):
        out_at = next(t for t, i, st in log if i == inst_id and st == "STOPPING")
        back_at = next(t for t, i, st in log if i == inst_id and st == "READY" and t > out_at)
        served = [t for t in load.done_at if out_at < t < back_at]
        assert served, f"no request answered while instance {inst_id} restarted ({back_at - out_at:.2f}s)"


def test_rolling_restart_under_load_reload_and_sighup(orch_run):
    run = orch_run().start()
    load = Load(run.url(GEN_PATH))
    try:
        time.sleep(1.0)
        assert load.ok > 0, load.failed[:3]
        _rolling(run, lambda: run.cli("reload", "--state-dir", str(run.state_dir), check=True), 1, load)
        ok_after_reload = load.ok
        assert not load.failed, load.failed[:5]
        daemon_pid = run.status()["daemon"]["pid"]
        _rolling(run, lambda: os.kill(daemon_pid, signal.SIGHUP), 2, load)
        time.sleep(0.5)
        assert load.ok > ok_after_reload
    finally:
        load.stop()
    assert not load.failed, f"{len(load.failed)} failed of {load.ok + len(load.failed)}: {load.failed[:5]}"
    assert load.ok > 20
    assert run.proc.poll() is None
    assert "rolling restart (SIGHUP)" in run.daemon_log()
    assert "rolling restart (reload requested)" in run.daemon_log()


def test_reload_while_rolling_is_refused(orch_run):
    from orchestrator.controlplane.control_socket import call_sync
    run = orch_run().start()
    sock = run.state_dir / "control.sock"
    assert call_sync(sock, "POST", "/reload")[0] == 202
    code, body = call_sync(sock, "POST", "/reload")  # milliseconds later: the first one still runs
    assert code == 409 and "already running" in body["error"], body
    out = run.cli("reload", "--state-dir", str(run.state_dir))  # CLI: refused while it runs, one line
    if out.returncode != 0:
        assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "already running" in out.stderr
    run.wait_for(lambda s: all(i["restarts"] >= 1 and i["state"] == "READY" for i in s["instances"])
                 and not s["daemon"]["rolling_restart"], 120, "rolling restart")
    assert run.daemon_log().count("rolling restart done") == (1 if out.returncode else 2)


# --- 3 + 4. logs and status ----------------------------------------------------------------
def _status_rows(text: str) -> dict[str, dict[str, str]]:
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("ID"))
    cols = lines[header].split()
    rows = {}
    for ln in lines[header + 1:]:
        if ln.startswith(" "):
            continue  # detail lines (gpu, reason, last failure)
        fields = ln.split()
        rows[fields[0]] = dict(zip(cols, fields))
    return rows


def _lines(data: bytes) -> list[bytes]:
    """Lines as `logs` reads them (split at b"\n" only, ends kept)."""
    return re.findall(rb"[^\n]*\n|[^\n]+$", data)


def _logs(run, *args: str) -> bytes:
    """`trtllm-orch logs ...` stdout as bytes (text mode would translate \r and bad UTF-8)."""
    out = subprocess.run([sys.executable, "-m", "orchestrator", "logs", *args], env=run.env, cwd=REPO,
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _a_tail_of(printed: bytes, before: bytes, after: bytes, n: int, keep=lambda ln: True) -> bool:
    """`printed` is the last n kept lines of the log as it was at some moment between the
    reads `before` and `after`: ranks may still write (mpirun forwards their output late),
    so the file can grow while the command reads it."""
    assert after.startswith(before), "the log was rewritten between the reads"
    ends = {len(before), len(after)} | {i + 1 for i in range(len(before), len(after)) if after[i] == 0x0A}
    for end in sorted(ends):
        kept = [ln for ln in _lines(after[:end]) if keep(ln)]
        if b"".join(kept[-n:]) == printed:
            return True
    return False


def test_logs_and_status(orch_run):
    # Patient probes: this test is about `logs` and `status`; a probe timing out on a
    # loaded machine would flip an instance to UNHEALTHY under the table checks below.
    run = orch_run(extra=("--probe-timeout-s", "5")).start()
    sd = ["--state-dir", str(run.state_dir)]

    # status: human table and JSON
    out = run.cli("status", *sd, check=True)
    rows = _status_rows(out.stdout)
    assert set(rows) == {"0", "1"}, out.stdout
    assert all(r["STATE"] == "READY" and r["RESTARTS"] == "0" for r in rows.values()), out.stdout
    js = run.status()
    for inst in js["instances"]:
        assert {"last_failure", "restarts", "inflight"} <= set(inst), inst
        assert inst["restarts"] == 0 and inst["inflight"] == 0 and inst["last_failure"] == ""

    # logs: last N lines of the whole group's log (the log may grow while we compare)
    log_file = Path(js["instances"][0]["log"])
    before = log_file.read_bytes()
    printed = _logs(run, "0", *sd, "--lines", "20")
    after = log_file.read_bytes()
    assert 0 < len(_lines(printed)) <= 20
    assert _a_tail_of(printed, before, after, 20), (printed[-500:], after[-2000:])
    everything = _logs(run, "0", *sd, "--lines", "100000").decode(errors="replace")
    launch = [ln for ln in everything.splitlines() if ln.startswith("[trtllm-orch] launch: ")]
    assert len(launch) == 1 and "--id=instance0-rank0" in launch[0], everything[:2000]
    assert "instance1-rank0" not in everything
    if len(_lines(before)) <= 20:
        assert b"[trtllm-orch] launch: " in printed

    # --rank 1: only rank 1's tagged lines, and there are some
    before = log_file.read_bytes()
    r1 = _logs(run, "0", *sd, "--rank", "1", "--lines", "1000")
    after = log_file.read_bytes()
    assert _lines(r1), "no rank-1 line"
    assert all(line_rank(ln) == 1 for ln in _lines(r1)), [ln for ln in _lines(r1) if line_rank(ln) != 1][:3]
    assert _a_tail_of(r1, before, after, 1000, keep=lambda ln: line_rank(ln) == 1), r1[-500:]

    # unknown instance: exit 2, one line
    out = run.cli("logs", "7", *sd)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "7" in out.stderr, out.stderr

    out = run.cli("logs", "0", *sd, "--lines", "-1")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    # `logs ID | head`: the reader going away is no error and no traceback (read end closed
    # before the command writes, so every run really hits EPIPE).
    closed = subprocess.Popen([sys.executable, "-m", "orchestrator", "logs", "0", *sd, "--lines", "100000"],
                              env=run.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    closed.stdout.close()
    stderr = closed.stderr.read().decode()
    assert closed.wait(30) == 0 and "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr

    # -f follows: a restart of instance 0 writes new lines (stop, exit code, new launch)
    follow = subprocess.Popen([sys.executable, "-m", "orchestrator", "logs", "0", *sd, "-f", "--lines", "5"],
                              env=run.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(iter(follow.stdout.readline, b"")), daemon=True)
    reader.start()
    try:
        _wait(lambda: len(got) >= 5, 15, "the first lines of logs -f")
        n0 = len(got)
        assert run.cli("restart", "0", *sd, check=True).stdout.strip() == "instance 0: restarting"
        try:
            _wait(lambda: any(b"[trtllm-orch] launch: " in ln for ln in got[n0:]), 120, "new launch line in logs -f")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\ndaemon log:\n{run.daemon_log()[-4000:]}") from None
        assert follow.poll() is None, "logs -f exited"
    finally:
        follow.terminate()
        follow.wait(10)
        reader.join(5)
    assert any(b"mpirun exited with code" in ln for ln in got[n0:]), got[n0:]

    # status after restart 0: restarts 1 for instance 0 only, back to READY
    run.wait_for(lambda s: s["instances"][0]["restarts"] == 1 and s["ready"] == 2, 60, "instance 0 restarted")
    rows = _status_rows(run.cli("status", *sd, check=True).stdout)
    assert (rows["0"]["STATE"], rows["0"]["RESTARTS"]) == ("READY", "1")
    assert (rows["1"]["STATE"], rows["1"]["RESTARTS"]) == ("READY", "0")
    out = run.cli("restart", "9", *sd)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


# --- 5. up --detach ---------------------------------------------------------------------------
def _daemon_pids_for(state_dir: Path) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "orchestrator" in cmd and "up" in cmd and str(state_dir) in cmd and p.pid != os.getpid():
            if alive(p.pid):
                out.append(p.pid)
    return out


def test_up_detach_returns_when_ready_then_down(orch_run):
    run = orch_run()
    daemon_pid = None
    try:
        t0 = time.monotonic()
        out = run.cli("up", *run.args, "--detach", timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        # The endpoint answers the moment `up --detach` returns.
        assert get_code(run.url("/v2/health/ready")) == 200
        code, body = post(run.url(GEN_PATH))
        assert code == 200 and body["text_output"]
        assert "ready: 2/2" in out.stdout, out.stdout
        status = run.status()
        assert status["ready"] == 2
        daemon_pid = status["daemon"]["pid"]
        assert alive(daemon_pid)
        mine = {c.pid for c in psutil.Process().children(recursive=True)}
        assert daemon_pid not in mine, "the daemon is still a child of the test"
        assert psutil.Process(daemon_pid).ppid() != os.getpid()
        assert time.monotonic() - t0 < 180
        # A second `up --detach` on the same state dir is refused without starting anything.
        again = run.cli("up", *run.args, "--detach", timeout=60)
        assert again.returncode != 0 and "already runs" in again.stderr
    finally:
        down = run.down()
    assert down.returncode == 0, down.stderr
    assert daemon_pid is not None
    _wait(lambda: not alive(daemon_pid), 10, "daemon exit")
    assert tagged(run.state_dir) == []
    assert _daemon_pids_for(run.state_dir) == []


def _broken_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "broken_repo"
    shutil.copytree(DEMO_REPO, repo, ignore=shutil.ignore_patterns("__pycache__"))
    model = repo / "tensorrt_llm" / "1" / "model.py"
    text = model.read_text()
    new, n = re.subn(r"(\n    def initialize\(self, args\):\n)",
                     r'\1        raise RuntimeError("deliberately broken model: boom-5f3a")\n', text, count=1)
    assert n == 1, "demo model has no initialize()"
    model.write_text(new)
    return repo


def test_up_detach_failing_model_exits_nonzero_with_log_tail(orch_run, tmp_path):
    run = orch_run(model_repo=_broken_repo(tmp_path), extra=("--max-failures", "1"))
    try:
        out = run.cli("up", *run.args, "--detach", timeout=180)
        assert out.returncode != 0, out.stdout + out.stderr
        assert "FAILED" in out.stderr, out.stderr
        # The failing instance's log tail, so the cause is on the screen.
        assert "[trtllm-orch]" in out.stderr or "boom-5f3a" in out.stderr, out.stderr
        print(out.stderr)
    finally:
        down = run.down()
    assert down.returncode == 0, down.stderr
    time.sleep(0.3)
    assert tagged(run.state_dir) == []
    assert _daemon_pids_for(run.state_dir) == []
    assert not (run.state_dir / "state.json").exists()


def test_reload_with_failed_instances_completes(orch_run, tmp_path):
    """A rolling restart retries FAILED instances and finishes, whatever their outcome."""
    run = orch_run(model_repo=_broken_repo(tmp_path), extra=("--max-failures", "1")).start(wait_ready=False)
    run.wait_for(lambda s: all(i["state"] == "FAILED" for i in s["instances"]), 60, "both FAILED")
    since = time.time() - 0.5
    assert run.cli("reload", "--state-dir", str(run.state_dir)).returncode == 0
    run.wait_for(lambda s: not s["daemon"]["rolling_restart"], 60, "rolling restart to finish")
    started = [inst for stamp, inst, old, new, _ in transitions(run.daemon_log())
               if stamp >= since and new == "STARTING"]
    assert started == ["0", "1"], started
    assert "rolling restart done" in run.daemon_log()
    assert all(i["state"] == "FAILED" for i in run.status()["instances"])
    # And the next reload is accepted, not refused as "already running".
    assert run.cli("reload", "--state-dir", str(run.state_dir)).returncode == 0
