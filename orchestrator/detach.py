"""`up --detach`: run the daemon in the background, return once the endpoint is ready."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

from orchestrator.config import Settings
from orchestrator.controlplane.control_socket import call_sync
from orchestrator.errors import DaemonNotRunning, OrchError
from orchestrator.controlplane.statedir import StateDir


def run_detached(argv: list[str], settings: Settings, sd: StateDir) -> int:
    sd.ensure()
    args = [a for a in argv if a != "--detach"]
    log = open(sd.daemon_log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    need = settings.ready_min or None
    deadline = time.monotonic() + settings.startup_timeout_s + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise OrchError(f"the daemon exited with code {proc.returncode}; its log: {sd.daemon_log_path}\n"
                            + _tail(sd))
        try:
            _, status = call_sync(sd.socket_path, "GET", "/status", timeout_s=5)
        except DaemonNotRunning:
            time.sleep(0.2)
            continue
        failed = [i for i in status["instances"] if i["state"] == "FAILED"]
        if failed:
            inst = failed[0]
            raise OrchError(f"instance {inst['id']} FAILED: {inst['reason']}\n" + "\n".join(inst["log_tail"])
                            + f"\n(the daemon, pid {proc.pid}, keeps running: `trtllm-orch down` stops it)")
        if status["ready"] >= (need or status["total"]):
            print(f"ready: {status['ready']}/{status['total']} instances behind {status['daemon']['listen']} "
                  f"(daemon pid {proc.pid}, log {sd.daemon_log_path})")
            return 0
        time.sleep(0.2)
    raise OrchError(f"not ready within {settings.startup_timeout_s + 30:g}s; see {sd.daemon_log_path}")


def wait_ready(sd: StateDir, timeout_s: float, which: Callable[[dict], bool] = lambda s: True) -> dict:
    """The status of the daemon on `sd` once `which(status)` holds and every instance is
    ready (an upgrade: the new daemon, its instances adopted)."""
    deadline = time.monotonic() + timeout_s
    last: dict | None = None
    while time.monotonic() < deadline:
        try:
            _, last = call_sync(sd.socket_path, "GET", "/status", timeout_s=5)
        except DaemonNotRunning:
            time.sleep(0.1)
            continue
        if which(last) and last["ready"] >= last["total"]:
            return last
        time.sleep(0.1)
    raise OrchError(f"no ready daemon within {timeout_s:g}s (last status: "
                    f"{(last or {}).get('ready', 0)}/{(last or {}).get('total', '?')} ready); "
                    f"see {sd.daemon_log_path}\n"
                    + _tail(sd))


def _tail(sd: StateDir, n: int = 15) -> str:
    try:
        return "\n".join(sd.daemon_log_path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
