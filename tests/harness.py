"""Run the real `trtllm-orch` CLI against real tritonserver/mpirun, for end-to-end tests and benches.

Every run gets its own state dir and free ports. `Run.close()` stops the daemon
with `down` and then checks, independently of the code under test, that no
process tagged with the run's state dir is left; a leftover is killed and
reported as a test failure rather than leaked into the next test.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
TRITON_ENV = REPO / ".triton" / "env"
DEMO_REPO = REPO / "demo" / "model_repo"


def triton_env() -> dict[str, str] | None:
    """Variables written by scripts/setup-triton, or None when it has not run."""
    if not TRITON_ENV.exists():
        return None
    env = {}
    for line in TRITON_ENV.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            env[key.strip()] = value.strip().strip('"').strip("'")
    return env


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports (bind-tested), below the ephemeral range.

    Never from the ephemeral range: there the kernel hands the same port to outgoing
    connections, so between our pick and tritonserver's bind a client (or a readiness
    poll to that very port, which can connect to itself) may take it, and the server
    fails with "already in use"."""
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(10000, low - n)
        if all(_bindable(port) for port in range(base, base + n)):
            return base
    raise RuntimeError("no free port block")


def free_port() -> int:
    return free_port_block(1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tagged(state_dir: Path) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("TRTLLM_ORCH_STATE_DIR") == str(state_dir) and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.Error, OSError):
            continue
    return out


def nginx_processes(state_dir: Path) -> list[psutil.Process]:
    """A managed NGINX of `state_dir` (`--proxy nginx`): masters started with its prefix, and their
    workers. Not `tagged`: nginx clears its workers' environment and retitles the master."""
    prefix = str(state_dir / "nginx")
    out: list[psutil.Process] = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if prefix in " ".join(proc.info["cmdline"] or []).split() and proc.status() != psutil.STATUS_ZOMBIE:
                out += [proc, *(c for c in proc.children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE)]
        except psutil.Error:
            continue
    return out


def daemons(state_dir: Path) -> list[psutil.Process]:
    """Daemons (`up`) serving `state_dir`, however started: one that `upgrade` started carries no
    tag in its environment (what the daemon starts does), only the directory on its command line."""
    want = str(state_dir)
    out = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        try:
            if "up" in cmd and any(a == "--state-dir" and b == want for a, b in zip(cmd, cmd[1:])) and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


_PORT_FLAGS = ("--base-port", "--listen", "--grpc-listen", "--metrics-listen")


class Run:
    def __init__(self, tmp: Path, *, gpus="0-3", tp=2, assume_gpus=4, proxy="embedded", extra=(),
                 env_extra: dict[str, str] | None = None, model_repo: Path = DEMO_REPO):
        tenv = triton_env()
        assert tenv is not None, "run scripts/setup-triton first"
        self.state_dir = tmp / "state"
        self.env = {**os.environ, "PYTHONPATH": tenv.get("PYTHONPATH", ""),
                    "LD_LIBRARY_PATH": tenv.get("LD_LIBRARY_PATH", ""),
                    "PATH": str(Path(tenv["MPIRUN"]).parent) + os.pathsep + os.environ.get("PATH", ""),
                    "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        self.args = [
            "--gpus", gpus, "--tp", str(tp), "--model-repo", str(model_repo),
            "--tritonserver", tenv["TRITONSERVER"],
            f"--tritonserver-arg=--backend-directory={tenv['BACKEND_DIR']}",
            "--mpirun", tenv["MPIRUN"],
            "--state-dir", str(self.state_dir), "--proxy", proxy, "--log-level", "debug", *extra,
            "--base-port", "", "--listen", "", "--grpc-listen", "", "--metrics-listen", ""]
        if assume_gpus is not None:
            self.args += ["--assume-gpus", str(assume_gpus)]
        self._pick_ports()
        self.log_path = tmp / "daemon.log"
        self.proc: subprocess.Popen | None = None

    def _pick_ports(self) -> None:
        """A new block of ports, written into `args` in place (tests edit the rest of `args`)."""
        base = free_port_block(3 * 8 + 3)
        self.base_port = base
        self.listen_port, self.grpc_port, self.metrics_port = base + 24, base + 25, base + 26
        values = (str(base), f"127.0.0.1:{self.listen_port}", f"127.0.0.1:{self.grpc_port}",
                  f"127.0.0.1:{self.metrics_port}")
        for flag, value in zip(_PORT_FLAGS, values):
            self.args[self.args.index(flag) + 1] = value

    def cli(self, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
        out = subprocess.run([sys.executable, "-m", "orchestrator", *args], env=self.env, cwd=REPO,
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"trtllm-orch {' '.join(args)} -> {out.returncode}: {out.stderr}")
        return out

    def start(self, wait_ready: bool = True, timeout: float = 90) -> "Run":
        """`up` in the background. A free port found is not reserved: another process (a sibling
        bench, a parallel test) may bind it before the daemon does, which then refuses to start
        ("address in use", exit 2, nothing started). Such a start is tried again on new ports."""
        for attempt in range(3):
            self._log = open(self.log_path, "wb")
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", *self.args],
                                         env=self.env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            if not wait_ready:
                return self
            try:
                self.wait_ready(timeout)
                return self
            except AssertionError:
                lost_ports = self.proc.poll() == 2 and "address in use" in self.daemon_log()
                ours = all(flag in self.args for flag in _PORT_FLAGS)  # not moved to a config file
                if not (lost_ports and ours) or attempt == 2:
                    raise
            self._log.close()
            self._pick_ports()
        return self

    def status(self) -> dict:
        out = self.cli("status", "--state-dir", str(self.state_dir), "--json", check=True)
        return json.loads(out.stdout)

    def wait_ready(self, timeout: float = 90, count: int | None = None) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.daemon_log()}")
            out = self.cli("status", "--state-dir", str(self.state_dir), "--json")
            if out.returncode == 0:
                last = json.loads(out.stdout)
                if last["ready"] >= (count if count is not None else last["total"]):
                    return last
            time.sleep(0.2)
        raise AssertionError(f"not ready in {timeout}s: {last}\n{self.daemon_log()}")

    def wait_for(self, predicate, timeout: float = 60, what: str = "condition") -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            out = self.cli("status", "--state-dir", str(self.state_dir), "--json")
            if out.returncode == 0:
                last = json.loads(out.stdout)
                if predicate(last):
                    return last
            time.sleep(0.1)
        raise AssertionError(f"{what} not reached in {timeout}s: {last}\n{self.daemon_log()[-4000:]}")

    def daemon_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.listen_port}{path}"

    def down(self) -> subprocess.CompletedProcess:
        out = self.cli("down", "--state-dir", str(self.state_dir), timeout=180)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        return out

    def close(self) -> list[int]:
        """Stop everything; return pids that had to be killed by the harness (should be []).
        A daemon the harness did not start (after `upgrade`) is a leak too, killed first: alive,
        it would start again what is killed after it."""
        if self.proc is not None and self.proc.poll() is None:
            self.down()
        own = self.proc.pid if self.proc is not None else None
        # (`down` returns once the daemon's process is gone: one still here was not stopped)
        strays = [d for d in daemons(self.state_dir) if d.pid != own]
        leaked = strays + tagged(self.state_dir) + nginx_processes(self.state_dir)
        for p in leaked:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if hasattr(self, "_log"):
            self._log.close()
        return [p.pid for p in leaked]


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_TRANSITION = re.compile(r"^\S+ \S+ \w+ instance=(\S+) gpus=\S+ (\w+) -> (\w+): (.*)$")


def descriptor_table(pid: int) -> int:
    """The size of a process's descriptor table (the kernel's FDSize)."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("FDSize:")).split()[1])


def open_limit(pid: int) -> int:
    """A process's RLIMIT_NOFILE soft limit."""
    with open(f"/proc/{pid}/limits") as f:
        return int(next(line for line in f if line.startswith("Max open files")).split()[3])


def log_stamp(line: str) -> float | None:
    """Epoch seconds of a daemon log line (cli.setup_logging's asctime format), or None."""
    m = _STAMP.match(line)
    if not m:
        return None
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_times(log_text: str, needle: str, after: float = 0.0) -> list[float]:
    """Timestamps of the daemon log lines containing `needle`, from `after` on."""
    out = []
    for line in log_text.splitlines():
        if needle in line:
            stamp = log_stamp(line)
            if stamp is not None and stamp >= after - 0.005:
                out.append(stamp)
    return out


def transitions(log_text: str) -> list[tuple[float, str, str, str, str]]:
    """(epoch seconds, instance, old state, new state, reason) from a daemon log."""
    out = []
    for line in log_text.splitlines():
        m = _TRANSITION.match(line)
        stamp = log_stamp(line) if m else None
        if m and stamp is not None:
            out.append((stamp, m.group(1), m.group(2), m.group(3), m.group(4)))
    return out
