"""A real Slurm cluster for the e2e tests: scripts/setup-slurm's slurmctld + two slurmd
"nodes", each in its own network namespace, and allocations in it.

The cluster belongs to the test module that starts it and is stopped (daemons killed,
namespaces deleted) when the module ends. One at a time on a machine: a lock file
serialises test sessions that would both want the fixed namespace names and subnet.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "scripts" / "setup-slurm"
NAMESPACES = {"node1": "orchslurm-n1", "node2": "orchslurm-n2"}
ADDRESSES = {"node1": "10.213.0.11", "node2": "10.213.0.12"}
LOCK = Path("/tmp/trtllm-orch-slurm-test.lock")


def cannot_run_here() -> str | None:
    """Why no Slurm cluster can start on this machine (a skip reason), or None."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (network namespaces, slurmd)"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists() and \
                not Path(f"/usr/bin/{tool}").exists():
            return f"{tool} is missing (iproute2 / util-linux)"
    probe = subprocess.run(["ip", "netns", "add", "orchslurm-probe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "delete", "orchslurm-probe"], capture_output=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    return None


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self._lock_fd: int | None = None

    def start(self) -> "SlurmCluster":
        self._lock_fd = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        out = subprocess.run([str(SETUP), "start", str(self.root)], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"scripts/setup-slurm start failed:\n{out.stdout}\n{out.stderr}")
        return self

    def stop(self) -> None:
        subprocess.run([str(SETUP), "stop", str(self.root)], capture_output=True, timeout=120)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})

    def allocate(self, nodes: int = 2, gpus: int = 2, *extra: str) -> str:
        """A fresh allocation (salloc --no-shell); --no-kill keeps it when a node fails."""
        out = self.run("salloc", "--no-shell", "--no-kill", f"-N{nodes}", f"--gres=gpu:{gpus}", *extra,
                       "-J", "trtllm-orch-test", timeout=60)
        m = re.search(r"Granted job allocation (\d+)", out.stderr + out.stdout)
        assert m, f"salloc failed: {out.stderr}"
        return m.group(1)

    def release(self, job_id: str) -> None:
        self.run("scancel", job_id)

    def steps(self) -> list[tuple[str, str, str]]:
        out = self.run("squeue", "-h", "-s", "-o", "%i|%j|%N")
        assert out.returncode == 0, out.stderr
        return [tuple(line.split("|")) for line in out.stdout.splitlines() if line.strip()]  # type: ignore[misc]

    def node_state(self, node: str) -> str:
        out = self.run("sinfo", "-h", "-N", "-n", node, "-O", "StateComplete")
        return out.stdout.strip()

    def slurmd(self, node: str, action: str) -> None:
        self._setup(f"slurmd-{action}", node)

    def link(self, node: str, action: str) -> None:
        """'down': the node's cable is pulled (its processes run on, unreachable); 'up': back."""
        self._setup(f"link-{action}", node)

    def _setup(self, command: str, node: str) -> None:
        out = subprocess.run([str(SETUP), command, str(self.root), node], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr

    def update_node(self, node: str, *fields: str) -> None:
        """scontrol update NodeName=NODE FIELDS... (what an operator does: State=DOWN, State=RESUME)."""
        out = self.run("scontrol", "update", f"NodeName={node}", *fields)
        assert out.returncode == 0, out.stderr

    def job_nodes(self, job_id: str) -> str:
        out = self.run("squeue", "-h", "-j", job_id, "-o", "%N")
        return out.stdout.strip()


def ns_processes(node: str) -> list[psutil.Process]:
    """Every live process in the node's network namespace."""
    out = subprocess.run(["ip", "netns", "pids", NAMESPACES[node]], capture_output=True, text=True)
    procs = []
    for pid in out.stdout.split():
        try:
            proc = psutil.Process(int(pid))
            if proc.status() != psutil.STATUS_ZOMBIE:
                procs.append(proc)
        except psutil.Error:
            continue
    return procs


def signal_node(node: str, sig: int) -> list[int]:
    """Send `sig` to every process in the node's namespace, until none is left unsignalled
    (a process may fork meanwhile): the whole machine at once, its slurmd and slurmstepd
    included. Returns the pids signalled."""
    done: set[int] = set()
    for _ in range(20):
        fresh = [p for p in ns_processes(node) if p.pid not in done]
        if not fresh:
            break
        for proc in fresh:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
            done.add(proc.pid)
    return sorted(done)


def ranks_on(node: str, instance_id: str | None = None) -> list[psutil.Process]:
    """tritonserver ranks running in the node's namespace (of one instance, if given)."""
    out = []
    for proc in ns_processes(node):
        try:
            if proc.name() != "tritonserver":
                continue
            if instance_id is None or proc.environ().get("TRTLLM_ORCH_INSTANCE") == instance_id:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def run_processes(node: str) -> list[str]:
    """What of a run is left on a node: everything in its namespace except the node's own slurmd."""
    left = []
    for proc in ns_processes(node):
        try:
            name = proc.name()
        except psutil.Error:
            continue
        if name != "slurmd":
            left.append(f"{proc.pid} {name}")
    return left


def assert_nodes_clean(nodes=("node1", "node2"), stepd_grace_s: float = 15.0) -> None:
    """Nothing of the run on any node: our processes at once; Slurm's own per-step daemon
    (slurmstepd, which outlives its step by its cleanup) within a few seconds."""
    ours = {n: [p for p in run_processes(n) if not p.endswith(" slurmstepd")] for n in nodes}
    assert not any(ours.values()), ours
    wait_until(lambda: not any(run_processes(n) for n in nodes), stepd_grace_s,
               "slurmstepd of the cancelled steps gone")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout:g}s")
