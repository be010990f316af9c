"""`trtllm-orch top` as an operator runs it: in a real terminal (tmux), against a real daemon.

Start it in a tmux pane, read the screen (capture-pane), see one row per instance, kill
a rank of instance 0 and see its row change (`--max-failures 1` keeps it FAILED, so the
change stays on screen), press `q` and check the program ended and the terminal is back
in canonical mode with echo. Then the fallback: stdout not a terminal gives one table.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.harness import REPO

pytestmark = pytest.mark.e2e

TMUX = shutil.which("tmux")


class Pane:
    """One tmux server of our own (-L), one session, one pane."""

    def __init__(self, name: str, command: str, width: int = 200, height: int = 30) -> None:
        # The commands run under `env -u COLUMNS -u LINES`: the test process may carry a
        # COLUMNS=80 that tmux passes on, and rich honours it over the pane's real size.
        self.name = name
        self._tmux(["new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height), command])

    def _tmux(self, args: list[str]) -> str:
        return subprocess.run([TMUX, "-L", self.name, *args], check=True, capture_output=True,
                              text=True, timeout=10).stdout

    def screen(self, escapes: bool = False) -> str:
        return self._tmux(["capture-pane", "-p", *(["-e"] if escapes else []), "-t", "top"])

    def keys(self, *keys: str) -> None:
        self._tmux(["send-keys", "-t", "top", *keys])

    def wait_for(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{what} not on screen within {timeout}s:\n{screen}")

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.name, "kill-server"], capture_output=True, timeout=10)


def row(screen: str, instance: str) -> str:
    for line in screen.splitlines():
        if line.startswith(f"{instance} "):
            return line
    return ""


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (scripts/bootstrap installs it)")
def test_top_in_a_terminal_follows_a_kill_and_quits(orch_run, tmp_path):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2,
                   extra=("--max-failures", "1", "--canary-interval-s", "0", "--stop-grace-s", "3"))
    run.start(timeout=120)
    stty = tmp_path / "stty.txt"
    script = tmp_path / "top.sh"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in run.env.items() if k in ("PATH", "PYTHONPATH",
                                                                                "LD_LIBRARY_PATH"))
    script.write_text(f"cd {shlex.quote(str(REPO))}\n"
                      f"env -u COLUMNS -u LINES {env} {shlex.quote(sys.executable)} -m orchestrator top "
                      f"--state-dir {shlex.quote(str(run.state_dir))}\n"
                      f"rc=$?\nstty -a > {shlex.quote(str(stty))}\necho TOP-EXITED $rc\nsleep 120\n")
    pane = Pane(f"orch-top-{os.getpid()}", f"bash {shlex.quote(str(script))}")
    try:
        screen = pane.wait_for(lambda s: "READY" in row(s, "0") and "READY" in row(s, "1"), 30,
                               "both instances READY")
        assert "trtllm-orch top" in screen and f"127.0.0.1:{run.listen_port}" in screen
        assert "policy prefix-affinity" in screen and "q or Ctrl-C: quit" in screen
        for name in ("STATE", "GPUS", "UPTIME", "RESTARTS", "INFLIGHT", "WAITING", "ACTIVE", "KV",
                     "TTFT p50", "TOK/s"):
            assert name in screen, name
        # kill -9 the rank of instance 0: its row must leave READY and end FAILED
        victim = next(i for i in run.status()["instances"] if i["id"] == "0")["pids"][-1]
        os.kill(victim, signal.SIGKILL)
        screen = pane.wait_for(lambda s: "FAILED" in row(s, "0"), 30, "instance 0 FAILED")
        assert "READY" in row(screen, "1")
        assert "ready 1/2" in screen
        pane.keys("q")
        screen = pane.wait_for(lambda s: "TOP-EXITED" in s, 10, "top exiting on q")
        assert "TOP-EXITED 0" in screen
        modes = stty.read_text().split()
        assert "icanon" in modes and "echo" in modes, "terminal not restored after top"
    finally:
        pane.close()


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (scripts/bootstrap installs it)")
def test_top_quits_on_ctrl_c(orch_run, tmp_path):
    run = orch_run(gpus="0", tp=1, assume_gpus=1, extra=("--canary-interval-s", "0"))
    run.start(timeout=120)
    out = tmp_path / "rc"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in run.env.items() if k in ("PATH", "PYTHONPATH"))
    cmd = (f"cd {shlex.quote(str(REPO))}; env -u COLUMNS -u LINES {env} {shlex.quote(sys.executable)} "
           "-m orchestrator top "
           f"--state-dir {shlex.quote(str(run.state_dir))}; echo $? > {shlex.quote(str(out))}; sleep 60")
    pane = Pane(f"orch-top-c-{os.getpid()}", f"bash -c {shlex.quote(cmd)}")
    try:
        pane.wait_for(lambda s: "READY" in row(s, "0"), 30, "instance 0 READY")
        pane.keys("C-c")
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert out.read_text().strip() == "0"
    finally:
        pane.close()


def test_top_without_a_terminal_prints_one_table(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, extra=("--canary-interval-s", "0"))
    run.start(timeout=120)
    t0 = time.monotonic()
    out = run.cli("top", "--state-dir", str(run.state_dir), timeout=30)  # stdout is a pipe
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 20  # one table, then it returns
    assert "\x1b" not in out.stdout  # no escape sequences into a file or pipe
    lines = out.stdout.splitlines()
    assert lines[0].startswith("trtllm-orch top") and f"127.0.0.1:{run.listen_port}" in lines[0]
    assert "READY" in row(out.stdout, "0") and "READY" in row(out.stdout, "1")
    missing = run.cli("top", "--state-dir", str(run.state_dir / "nowhere"), timeout=30)
    assert missing.returncode != 0 and "no daemon" in missing.stderr


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (scripts/bootstrap installs it)")
def test_up_on_a_terminal_shows_engines_loading_until_ready(orch_run, tmp_path):
    """`up` in a terminal: per instance the elapsed time and the engine's last log line, then READY."""
    repo = tmp_path / "repo"
    subprocess.run([sys.executable, str(REPO / "demo" / "fill_template.py"), "--repo", str(repo), "--streaming",
                    "twin_engine_load_time_s:15"], check=True, capture_output=True, timeout=60)
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, model_repo=repo, extra=("--log-level", "info"))
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in run.env.items() if k in ("PATH", "PYTHONPATH",
                                                                                "LD_LIBRARY_PATH"))
    cmd = (f"cd {shlex.quote(str(REPO))}; env -u COLUMNS -u LINES {env} {shlex.quote(sys.executable)} -m orchestrator "
           f"up {' '.join(shlex.quote(a) for a in run.args)}; sleep 120")
    pane = Pane(f"orch-up-{os.getpid()}", cmd, width=160, height=20)
    try:
        # 15 s of engine load leave a window wide enough for a loaded machine (the log line
        # reaches the daemon through mpirun's output pipe, some time after the launch).
        screen = pane.wait_for(lambda s: "loading engine: 15s" in row(s, "0") and "STARTING" in row(s, "0"), 60,
                               "engines loading")
        assert "loading engines" in screen and "ELAPSED" in screen
        assert "rank 0: [twin tensorrt_llm] loading engine: 15s" in row(screen, "0")
        screen = pane.wait_for(lambda s: "ready in" in row(s, "0") and "ready in" in row(s, "1"), 60,
                               "both READY")
        assert screen.rstrip().splitlines()[-1].startswith("1 "), "the summary stays under the log lines"
        assert "STOPPED -> STARTING" in screen  # log lines print above the block, not through it
    finally:
        run.cli("down", "--state-dir", str(run.state_dir), timeout=120)
        pane.close()
