"""Issue 23 under a real systemd: the rendered unit (`install-service`) run by systemd 252
as PID 1 of a pid+mount+uts namespace, with the service's real engines (tritonserver
ranks under mpirun, the twin) and data-plane workers. Under load:

  kill -9 of the daemon's main pid      Restart= starts the next daemon, which adopts;
  the daemon SIGSTOPped past WatchdogSec systemd kills it alone (KillMode=process), restarts
                                        it, and it adopts;
  systemctl kill -s USR2                the daemon detaches (exit 75), Restart= starts it, it adopts;
  systemctl restart                     the daemon sees its unit's restart job and detaches, the
                                        job's start adopts (and `systemctl stop` stops all).

In each: 0 failed requests, the same engine pids.

The namespace is made safe first: systemd's boot wiped the shared /tmp on a first try
(systemd-tmpfiles' "D /tmp" in sysinit.target). So /run, /tmp, /var/log/journal and the
unit directory are tmpfs of the namespace alone, sysinit.target and everything that
writes outside it are masked, the state directory lives in /var/tmp, and a drop-in gives
the service DefaultDependencies=no (sysinit.target is masked) and a log file (journald is
masked). The watchdog case shortens WatchdogSec in a drop-in: 30 s, then SIGABRT, which a
stopped process does not act on, then SIGKILL after TimeoutStopSec (90 s) is the same path,
two minutes longer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.harness import REPO, free_port_block, tagged, triton_env
from tests.test_e2e_faults import Load
from tests.test_e2e_live_restore import Streams, engine_pids

pytestmark = pytest.mark.e2e

SYSTEMD = "/lib/systemd/systemd"
MASKED = ("sysinit.target basic.target local-fs.target timers.target getty.target network-online.target "
          "systemd-tmpfiles-setup.service systemd-tmpfiles-setup-dev.service systemd-tmpfiles-clean.timer "
          "systemd-tmpfiles-clean.service systemd-sysctl.service systemd-sysusers.service systemd-udevd.service "
          "systemd-journald.service systemd-journald.socket systemd-journald-dev-log.socket "
          "systemd-journald-audit.socket systemd-random-seed.service systemd-update-utmp.service "
          "systemd-remount-fs.service systemd-modules-load.service systemd-binfmt.service "
          "systemd-firstboot.service ldconfig.service systemd-logind.service dbus.service dbus.socket").split()
# The cgroups systemd creates in the shared v1 hierarchies; removed (when empty) at the end.
CGROUPS = ("init.scope", "system.slice", "user.slice", "dev-hugepages.mount", "dev-mqueue.mount",
           "sys-kernel-debug.mount", "sys-kernel-tracing.mount", "sys-fs-fuse-connections.mount",
           "proc-sys-fs-binfmt_misc.mount")
BOOT = """#!/bin/sh
set -e
mount --make-rprivate /
mount -t tmpfs -o mode=755 tmpfs /run
# What the service runs from and lives under /tmp (a clone checked there): kept visible
# through the private /tmp by a bind mount parked in the private /run meanwhile.
i=0
for keep in {keep}; do mkdir -p /run/keep$i && mount --bind "$keep" /run/keep$i; i=$((i+1)); done
mount -t tmpfs -o mode=1777 tmpfs /tmp
i=0
for keep in {keep}; do mkdir -p "$keep" && mount --bind /run/keep$i "$keep"; i=$((i+1)); done
mount -t tmpfs -o mode=755 tmpfs /etc/systemd/system
if [ -d /var/log/journal ]; then mount -t tmpfs -o mode=755 tmpfs /var/log/journal; fi
for u in {masked}; do ln -s /dev/null /etc/systemd/system/$u; done
printf '[Unit]\\nDefaultDependencies=no\\n' > /etc/systemd/system/nstest.target
export container=other
exec {systemd} --system --unit=nstest.target --show-status=0
"""


class Namespace:
    """systemd as PID 1 of its own namespace; `sh` runs a command in it."""

    def __init__(self, work: Path) -> None:
        self.work = work
        boot = work / "boot.sh"
        keep = sorted({str(p) for p in (REPO, Path(sys.prefix)) if Path("/tmp") in p.resolve().parents})
        boot.write_text(BOOT.format(masked=" ".join(MASKED), systemd=SYSTEMD,
                                    keep=" ".join(f"'{k}'" for k in keep)))
        boot.chmod(0o755)
        self.unshare = subprocess.Popen(["unshare", "--pid", "--fork", "--mount", "--uts", "--mount-proc", str(boot)],
                                        stdout=open(work / "boot.log", "wb"), stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid1 = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.pid1 is None:
            time.sleep(0.2)
            try:
                kids = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children").read_text().split()
            except OSError:
                break
            self.pid1 = (int(kids[0]) if kids and Path(f"/proc/{kids[0]}/exe").resolve() == Path(SYSTEMD).resolve()
                         else None)

    def sh(self, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(["nsenter", "-t", str(self.pid1), "-m", "-p", "-u", *argv],
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} -> {out.returncode}: {out.stdout}{out.stderr}")
        return out

    def booted(self) -> str:
        """'' when systemd answers and runs, else why not."""
        if self.pid1 is None:
            return f"no systemd PID 1 appeared: {(self.work / 'boot.log').read_text(errors='replace')[-500:]}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            out = self.sh("systemctl", "is-system-running", check=False, timeout=10)
            if out.stdout.strip() in ("running", "degraded"):
                return ""
            time.sleep(0.3)
        return f"systemctl is-system-running: {out.stdout.strip()} {out.stderr.strip()}"

    def close(self) -> None:
        if self.pid1 is not None:
            os.kill(self.pid1, signal.SIGKILL)  # PID 1 of the namespace: every process in it dies
        else:
            os.killpg(self.unshare.pid, signal.SIGKILL)
        self.unshare.wait(10)
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            for name in CGROUPS:
                d = hierarchy / name
                if d.is_dir():
                    for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [d]:
                        try:
                            sub.rmdir()
                        except OSError:
                            pass


@pytest.fixture
def systemd_ns():
    if os.geteuid() != 0 or not os.path.exists(SYSTEMD) or not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.skip("needs root, systemd, unshare and nsenter")
    if triton_env() is None:
        pytest.skip("no .triton/env: run scripts/setup-triton")
    work = Path("/var/tmp") / f"trtllm-orch-systemd-{uuid.uuid4().hex[:8]}"  # /tmp is private in there
    work.mkdir()
    ns = Namespace(work)
    try:
        why = ns.booted()
        if why:
            pytest.skip(f"systemd does not boot in a namespace here: {why}")
        yield ns
    finally:
        left = tagged(work / "state")
        ns.close()
        shutil.rmtree(work, ignore_errors=True)
        assert not left or all(not p.is_running() for p in left), f"left running: {left}"


class Service:
    """The unit `install-service` renders, installed and started in the namespace."""

    def __init__(self, ns: Namespace, drop_in: str = "") -> None:
        self.ns = ns
        tenv = triton_env()
        base = free_port_block(27)
        self.state_dir = ns.work / "state"
        self.listen_port = base + 24
        config = ns.work / "trtllm-orch.toml"
        config.write_text("\n".join([
            'gpus = "0-1"', "tp = 1", "assume_gpus = 2", f'model_repo = "{REPO / "demo" / "model_repo"}"',
            f'tritonserver = "{tenv["TRITONSERVER"]}"',
            f'tritonserver_arg = ["--backend-directory={tenv["BACKEND_DIR"]}"]',
            f'mpirun = "{tenv["MPIRUN"]}"', f'state_dir = "{self.state_dir}"', f"base_port = {base}",
            f'listen = "127.0.0.1:{base + 24}"', f'grpc_listen = "127.0.0.1:{base + 25}"',
            f'metrics_listen = "127.0.0.1:{base + 26}"', 'proxy_workers = "2"', ""]))
        self.env = {**os.environ, "PYTHONPATH": tenv.get("PYTHONPATH", ""),
                    "LD_LIBRARY_PATH": tenv.get("LD_LIBRARY_PATH", ""),
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env = [f"{k}={self.env[k]}" for k in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")]
        ns.sh("env", *env, str(Path(sys.executable).parent / "trtllm-orch"), "install-service",
              "--config", str(config), "--unit-dir", "/etc/systemd/system")
        self.log = ns.work / "daemon.log"
        (ns.work / "nstest.conf").write_text(
            f"[Unit]\nDefaultDependencies=no\n[Service]\nStandardOutput=append:{self.log}\n"
            f"StandardError=inherit\n{drop_in}")
        ns.sh("sh", "-c", f"mkdir -p /etc/systemd/system/trtllm-orch.service.d && "
              f"cp {ns.work / 'nstest.conf'} /etc/systemd/system/trtllm-orch.service.d/ && systemctl daemon-reload")
        ns.sh("systemctl", "start", "trtllm-orch.service", timeout=180)  # Type=notify: returns at READY=1

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.listen_port}{path}"

    def status(self) -> dict | None:
        out = subprocess.run([sys.executable, "-m", "orchestrator", "status", "--state-dir", str(self.state_dir),
                              "--json"], env=self.env, cwd=REPO, capture_output=True, text=True, timeout=30)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def prop(self, name: str) -> str:
        return self.ns.sh("systemctl", "show", "-p", name, "--value", "trtllm-orch.service").stdout.strip()

    def wait_adopted(self, old_daemon: int, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st and st["daemon"]["pid"] != old_daemon and st["ready"] == st["total"] and \
                    self.prop("ActiveState") == "active":
                return st
            time.sleep(0.2)
        raise AssertionError(f"not adopted in {timeout}s: {self.status()}\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.ns.sh("systemctl", "stop", "trtllm-orch.service", timeout=180)


def under_load(svc: Service, fault, restarts_by_systemd: int = 1) -> dict:
    """Start load, apply `fault` (given the daemon's pid), wait for the next daemon to adopt."""
    before = svc.status()
    restarts = int(svc.prop("NRestarts"))
    streams = Streams(svc, tokens=8)
    with Load(svc, threads=2) as load:
        streams.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        fault(before["daemon"]["pid"])
        after = svc.wait_adopted(before["daemon"]["pid"])
        back_s = time.monotonic() - t0
        time.sleep(1.0)
        streams.stop.set()
    streams.join(60)
    print(f"back and adopted {back_s:.1f}s after the fault; {load.ok} HTTP ok, {len(load.failures)} failed, "
          f"{streams.done} streams, {len(streams.cut)} cut; NRestarts {restarts} -> {svc.prop('NRestarts')}")
    assert load.failures == [] and streams.cut == [], (load.failures[:3], streams.cut[:3])
    assert engine_pids(after) == engine_pids(before)
    assert all(i["adopted"] and i["state"] == "READY" for i in after["instances"]), after["instances"]
    assert int(svc.prop("NRestarts")) == restarts + restarts_by_systemd
    return {"back_s": back_s, "ok": load.ok}


def test_kill_9_of_the_daemon_under_systemd_restarts_it_and_it_adopts(systemd_ns):
    svc = Service(systemd_ns)
    under_load(svc, lambda pid: systemd_ns.sh("kill", "-9", str(pid)))
    svc.stop()


def test_a_watchdog_timeout_kills_the_daemon_alone_and_the_next_one_adopts(systemd_ns):
    svc = Service(systemd_ns, drop_in="WatchdogSec=3\nTimeoutAbortSec=2\n")
    out = under_load(svc, lambda pid: systemd_ns.sh("kill", "-STOP", str(pid)))
    assert out["back_s"] >= 3  # not before the watchdog's period
    svc.stop()


def test_systemctl_kill_usr2_upgrades_in_place(systemd_ns):
    svc = Service(systemd_ns)
    under_load(svc, lambda pid: systemd_ns.sh("systemctl", "kill", "-s", "USR2", "--kill-whom=main",
                                              "trtllm-orch.service"))
    svc.stop()


def test_systemctl_restart_restarts_the_daemon_alone_and_stop_stops_everything(systemd_ns):
    """`systemctl restart` (a package upgrade's): the daemon sees its unit's restart job on
    SIGTERM and detaches; the job's start adopts. `systemctl stop` then stops the engines."""
    svc = Service(systemd_ns)
    under_load(svc, lambda pid: systemd_ns.sh("systemctl", "restart", "trtllm-orch.service", timeout=180),
               restarts_by_systemd=0)  # NRestarts counts Restart='s, not a restart asked for
    assert "systemctl restart" in svc.log.read_text()
    engines = [i["mpirun_pid"] for i in svc.status()["instances"]]
    svc.stop()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in engines), "systemctl stop left an engine running"
