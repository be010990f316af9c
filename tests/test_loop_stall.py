"""The event loop that serves traffic never blocks while a group restarts (issue 9, item 3).

The daemon runs in this process (same code as `up`: cli.prepare + Daemon.run) with
two real tritonserver instances under mpirun, behind its embedded proxy, while
eight clients send requests through it. Instance 0 gets a clean restart and
instance 1 loses a rank to kill -9 (the failed-group path), and `status` asks for
GPU usage. Meanwhile every callback the loop runs is timed, and the calls that
block (scanning /proc, the socket table, NVML, fsync, subprocess) are recorded
when made from the loop's thread.

Time is taken as the loop thread's CPU time per callback: wall time on this
shared 2-core box also counts the moments the scheduler ran something else, which
says nothing about our code. Calls that block without burning CPU (fsync, NVML,
waiting on a child) are what the call guard catches.

The daemon runs here on asyncio's own loop (pytest's), where every callback is an
asyncio Handle this test can time. `trtllm-orch up` runs the same daemon code on
uvloop when it is installed (cli.cmd_up); uvloop's callbacks are not Python Handles,
so this test does not time them there: what it proves is that our code never blocks,
whichever loop runs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time

import aiohttp
import psutil
import pytest

from orchestrator.cli import prepare
from orchestrator.config import Settings
from orchestrator.controlplane.daemon import Daemon
from orchestrator.launcher.process_tree import tagged_processes
from orchestrator.controlplane.states import State
from orchestrator.controlplane.statedir import StateDir
from tests.harness import DEMO_REPO, free_port_block, triton_env

pytestmark = pytest.mark.process

STALL_MS = 50.0
BODY = json.dumps({"text_input": "hello", "max_tokens": 2, "bad_words": "", "stop_words": ""})


class CallbackTimer:
    """Times every callback the (pure-Python) event loop runs, in the loop thread's CPU time."""

    def __init__(self) -> None:
        self.worst_cpu_ms = 0.0
        self.worst_wall_ms = 0.0
        self.worst_handle = ""
        self.count = 0

    def install(self, monkeypatch) -> None:
        original = asyncio.events.Handle._run
        timer = self

        def timed(handle):
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            try:
                return original(handle)
            finally:
                cpu = (time.thread_time() - cpu0) * 1000
                timer.count += 1
                timer.worst_wall_ms = max(timer.worst_wall_ms, (time.perf_counter() - wall0) * 1000)
                if cpu > timer.worst_cpu_ms:
                    timer.worst_cpu_ms, timer.worst_handle = cpu, repr(handle)[:300]

        monkeypatch.setattr(asyncio.events.Handle, "_run", timed)


class BlockingCallGuard:
    """Records blocking calls made on the event loop's thread."""

    def __init__(self, loop_thread: threading.Thread) -> None:
        self.loop_thread = loop_thread
        self.violations: list[str] = []
        self.armed = False

    def wrap(self, monkeypatch, owner, name: str) -> None:
        original = getattr(owner, name)
        guard = self

        def checked(*args, **kwargs):
            if guard.armed and threading.current_thread() is guard.loop_thread:
                guard.violations.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, checked)


class FakeNvml:
    """NVML as slow as a real one (tens of ms per call), recording which thread asks."""

    def __init__(self, guard: BlockingCallGuard) -> None:
        self.guard = guard
        self.calls = 0

    def _slow(self, what: str) -> None:
        self.calls += 1
        if self.guard.armed and threading.current_thread() is self.guard.loop_thread:
            self.guard.violations.append(f"nvml.{what}")
        time.sleep(0.06)

    def holders(self, gpus):
        self._slow("gpu_holders")
        return set()

    def usage(self, gpus):
        self._slow("gpu_usage")
        return {g: {"index": g, "memory_used_mib": 0, "memory_total_mib": 1, "utilization_pct": 0} for g in gpus}


class Load:
    def __init__(self, url: str, workers: int = 8) -> None:
        self.url, self.workers = url, workers
        self.ok = self.failed = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "Load":
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]
        return self

    async def _worker(self) -> None:
        while not self._stop.is_set():
            try:
                async with self._session.post(self.url, data=BODY) as resp:
                    await resp.read()
                    if resp.status == 200:
                        self.ok += 1
                    else:
                        self.failed += 1
            except aiohttp.ClientError:
                self.failed += 1

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()


def _rank_pid(mpirun_pid: int) -> int:
    for child in psutil.Process(mpirun_pid).children(recursive=True):
        if child.name() == "tritonserver":
            return child.pid
    raise AssertionError(f"no tritonserver under mpirun {mpirun_pid}")


async def _relaunched(inst, before: int, timeout: float = 90) -> None:
    await asyncio.wait_for(inst.wait_for(lambda: inst.launches > before and inst.state == State.READY), timeout)


async def test_no_loop_stall_during_group_restarts_under_load(tmp_path, monkeypatch):
    tenv = triton_env()
    if tenv is None:
        pytest.skip("no .triton/env: run scripts/setup-triton (the README's test command does)")
    base, listen = free_port_block(6), free_port_block(1)
    settings = Settings(gpus="0-1", tp=1, assume_gpus=2, model_repo=str(DEMO_REPO),
                        tritonserver=tenv["TRITONSERVER"], mpirun=tenv["MPIRUN"],
                        tritonserver_arg=(f"--backend-directory={tenv['BACKEND_DIR']}",),
                        state_dir=str(tmp_path / "state"), base_port=base, listen=f"127.0.0.1:{listen}",
                        grpc_listen="", metrics_listen="", stop_grace_s=5.0, canary_interval_s=0)
    prepared = await asyncio.to_thread(prepare, settings, for_launch=True)
    guard = BlockingCallGuard(threading.current_thread())
    nvml = FakeNvml(guard)
    sd = StateDir(settings.resolved_state_dir())
    daemon = Daemon(settings, prepared.plan, prepared.build_command, sd,
                    gpu_holders=nvml.holders, gpu_usage=nvml.usage)
    run = asyncio.create_task(daemon.run())
    try:
        deadline = time.monotonic() + 90
        while daemon.ready_count() < 2:
            assert not run.done(), run
            assert time.monotonic() < deadline, "instances not ready"
            await asyncio.sleep(0.05)
        timer = CallbackTimer()
        timer.install(monkeypatch)
        for owner, name in ((psutil, "process_iter"), (psutil, "net_connections"), (os, "fsync"),
                            (subprocess, "run")):
            guard.wrap(monkeypatch, owner, name)
        guard.armed = True
        async with Load(f"http://127.0.0.1:{listen}/v2/models/ensemble/generate") as load:
            await asyncio.sleep(0.5)
            inst0, inst1 = daemon.instances["0"], daemon.instances["1"]
            before = inst0.launches
            inst0.request_restart()  # a clean stop: SIGTERM, grace, release checks
            await _relaunched(inst0, before)
            before = inst1.launches
            os.kill(_rank_pid(inst1.group.mpirun_pid), signal.SIGKILL)  # a failed group
            await _relaunched(inst1, before)
            status = await daemon.status()
            await asyncio.sleep(0.5)
        guard.armed = False
        monkeypatch.undo()
    finally:
        daemon.request_stop("test done")
        await asyncio.wait_for(run, 60)
    assert run.result() == 0
    assert [i["state"] for i in status["instances"]] == ["READY", "READY"]
    assert nvml.calls > 0, "the release wait never asked NVML: the test would not see it block"
    assert load.ok > 0
    assert guard.violations == [], f"blocking calls on the event loop: {sorted(set(guard.violations))}"
    assert timer.worst_cpu_ms < STALL_MS, (
        f"a callback held the loop {timer.worst_cpu_ms:.1f} ms (CPU; wall {timer.worst_wall_ms:.1f} ms) "
        f"of {timer.count}: {timer.worst_handle}")
    assert not await asyncio.to_thread(tagged_processes, str(sd.root)), "processes left after stop"
    print(f"worst callback: {timer.worst_cpu_ms:.1f} ms CPU, {timer.worst_wall_ms:.1f} ms wall, of {timer.count}; "
          f"{load.ok} requests ok, {load.failed} failed")
