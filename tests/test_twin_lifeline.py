"""The twin's engine stub leaves with its server even while a stub thread holds the
GIL in a call that never returns (a pb_utils round trip to a dead server does)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.test_e2e_faults import alive

pytestmark = pytest.mark.process

DEMO = Path(__file__).resolve().parent.parent / "demo"

# The "stub": start the lifeline, report ready, then block in libc sleep through
# ctypes.PyDLL, which keeps the GIL for the whole call.
STUB = f"""
import ctypes, sys
sys.path.insert(0, {str(DEMO)!r})
from twin.lifeline import exit_with_server
exit_with_server()
print("ready", flush=True)
ctypes.PyDLL(None).sleep(120)
"""

# The "server": start the stub with its stdout on our pipe, pass on its pid, wait.
SERVER = f"""
import subprocess, sys, time
stub = subprocess.Popen([sys.executable, "-c", {STUB!r}], stdout=subprocess.PIPE, text=True)
assert stub.stdout.readline() == "ready\\n"
print(stub.pid, flush=True)
time.sleep(120)
"""


def _ends(p: psutil.Process, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while alive(p) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(p)


def test_a_stub_that_holds_the_gil_dies_with_its_server_and_leaves_no_watcher():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    started: list[psutil.Process] = []
    try:
        stub = psutil.Process(int(server.stdout.readline()))
        watchers = stub.children()
        started += [stub, *watchers]
        assert len(watchers) == 1, watchers        # the lifeline runs in a process of its own
        held = [os.readlink(f"/proc/{watchers[0].pid}/fd/{fd}") for fd in os.listdir(f"/proc/{watchers[0].pid}/fd")]
        assert not [h for h in held if h.startswith(("pipe:", "socket:"))], held   # not the rank's output pipe
        server.kill()
        server.wait(10)
        assert _ends(stub, 5.0), "the stub outlived its server"
        assert _ends(watchers[0], 5.0), "the watcher outlived the stub"
    finally:
        server.kill()
        for p in started:
            if alive(p):
                p.kill()


def test_the_watcher_leaves_when_its_stub_ends_first():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        stub = psutil.Process(int(server.stdout.readline()))
        watcher = stub.children()[0]
        stub.kill()
        assert _ends(watcher, 5.0), "the watcher outlived its stub"
        assert server.poll() is None               # and the server was left alone
    finally:
        server.kill()
        server.wait(10)
