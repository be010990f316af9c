"""A worker's descriptor table grown once at start-up (orchestrator/dataplane/descriptors.py):
the kernel's table holds what was asked, within RLIMIT_NOFILE, and no descriptor moved,
closed or was left open. Each case runs in a child process, with a second thread as a
worker has (the table is then shared, and the kernel's growth waits for RCU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import REPO

pytestmark = pytest.mark.process

CHILD = r"""
import json, os, resource, sys, threading, time
from orchestrator.dataplane import descriptors
from tests.harness import descriptor_table

threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
soft = int(sys.argv[2])
if soft:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

def open_fds():
    out = {}
    for n in os.listdir("/proc/self/fd"):
        try:
            out[int(n)] = os.readlink(f"/proc/self/fd/{n}")
        except FileNotFoundError:  # the listing's own, closed by now
            pass
    return out

keep = os.open(os.devnull, os.O_RDONLY)  # a descriptor of the process's own, to be left alone
before_size, before = descriptor_table(os.getpid()), open_fds()
got = descriptors.reserve(int(sys.argv[1]))
after = open_fds()
os.close(keep)
print(json.dumps({"got": got, "before_size": before_size, "after_size": descriptor_table(os.getpid()),
                  "same": before == after, "keep_open": keep in after}))
"""


def reserve_in_child(count: int, soft: int = 0) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(count), str(soft)], capture_output=True, text=True,
                         timeout=60, check=True, cwd=REPO)  # the child imports tests.harness
    return json.loads(out.stdout)


def test_the_table_holds_what_was_asked_and_no_descriptor_moves_or_stays_open():
    r = reserve_in_child(5000)
    assert r["before_size"] < 5000  # else the case proves nothing
    assert r["got"] == 5000 and r["after_size"] >= 5000
    assert r["same"] and r["keep_open"]


def test_the_table_is_grown_only_as_far_as_the_process_may_open():
    r = reserve_in_child(100_000, soft=2048)
    assert r["got"] == 2048 and 2048 <= r["after_size"] < 100_000
    assert r["same"]


def test_a_table_already_large_enough_is_left_as_it_is():
    r = reserve_in_child(16)
    assert r["after_size"] == r["before_size"] and r["same"]


def test_a_worker_reserves_two_per_client_and_no_more_than_the_cap():
    from orchestrator.dataplane import descriptors
    assert descriptors.wanted(4096) == 2 * 4096 + descriptors.SLACK
    assert descriptors.wanted(1_000_000) == descriptors.RESERVE_MAX  # not 8 MB per worker up front
    assert descriptors.wanted(4096, soft_limit=1024) == 1024  # no more than the process may open
