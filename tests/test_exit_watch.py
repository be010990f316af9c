"""ExitWatcher with real processes: children, grandchildren, orphans; latency and fd hygiene."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import psutil
import pytest

from orchestrator.health.exit_watch import ExitWatcher

pytestmark = pytest.mark.process

# With pidfd the kill-to-callback latency is a few ms; the limits are generous so a
# loaded machine stays green (test_pidfd_latency_is_event_driven checks the real bound).
PIDFD_LIMIT_S = 0.5
POLL_LIMIT_S = 1.0

MODES = [pytest.param(True, id="pidfd"), pytest.param(False, id="psutil-poll")]
if not hasattr(os, "pidfd_open"):
    MODES = [pytest.param(False, id="psutil-poll")]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Spawned(list):
    """Popen objects a test started, plus grandchild pids that are not ours to wait for."""

    def __init__(self) -> None:
        super().__init__()
        # psutil.Process remembers the create time, so kill() never hits a reused pid.
        self.strays: list[psutil.Process] = []


@pytest.fixture
def procs() -> Iterator[Spawned]:
    """Every process a test starts; all killed (and children reaped) at the end, whatever happened."""
    started = Spawned()
    yield started
    for stray in started.strays:
        try:
            stray.kill()
        except psutil.NoSuchProcess:
            pass
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


def sleeper(procs: Spawned) -> subprocess.Popen:
    p = subprocess.Popen(["sleep", "30"])
    procs.append(p)
    return p


def grandchild(procs: Spawned) -> tuple[subprocess.Popen, int]:
    """sh starts `sleep 30` and waits for it: the sleep's parent is sh, not us."""
    parent = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    procs.append(parent)
    pid = int(parent.stdout.readline())
    procs.strays.append(psutil.Process(pid))
    return parent, pid


async def kill_and_time(watcher: ExitWatcher, pid: int, limit_s: float) -> float:
    """SIGKILL pid and return how long until its callback ran."""
    loop = asyncio.get_running_loop()
    fired: asyncio.Future[int] = loop.create_future()
    assert watcher.watch(pid, fired.set_result)
    assert pid in watcher.watched
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    got = await asyncio.wait_for(fired, timeout=5.0)
    elapsed = time.monotonic() - start
    assert got == pid
    assert elapsed < limit_s, f"callback {elapsed:.3f}s after the kill"
    assert pid not in watcher.watched
    return elapsed


@pytest.mark.parametrize("use_pidfd", MODES)
async def test_child_exit_fires_callback_quickly(procs, use_pidfd: bool) -> None:
    p = sleeper(procs)
    with ExitWatcher(use_pidfd=use_pidfd) as w:
        await kill_and_time(w, p.pid, PIDFD_LIMIT_S if use_pidfd else POLL_LIMIT_S)


@pytest.mark.parametrize("use_pidfd", MODES)
async def test_grandchild_exit_is_seen(procs, use_pidfd: bool) -> None:
    parent, pid = grandchild(procs)
    assert pid != parent.pid
    with ExitWatcher(use_pidfd=use_pidfd) as w:
        await kill_and_time(w, pid, PIDFD_LIMIT_S if use_pidfd else POLL_LIMIT_S)
        # Killing the grandchild does not kill its parent (sh's wait just returns).
        parent.wait(timeout=5)


@pytest.mark.parametrize("use_pidfd", MODES)
async def test_orphan_exit_is_seen(procs, use_pidfd: bool) -> None:
    # Like mpirun's ranks after mpirun was SIGKILLed: the parent is gone, the rank lives on.
    parent, pid = grandchild(procs)
    with ExitWatcher(use_pidfd=use_pidfd) as w:
        parent.kill()
        parent.wait()
        os.kill(pid, 0)  # still running, now adopted by init or a subreaper
        await kill_and_time(w, pid, PIDFD_LIMIT_S if use_pidfd else POLL_LIMIT_S)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open")
async def test_pidfd_latency_is_event_driven(procs) -> None:
    # Several kills, best case well under the fallback's 100 ms poll: proves no polling.
    with ExitWatcher() as w:
        best = min([await kill_and_time(w, sleeper(procs).pid, PIDFD_LIMIT_S) for _ in range(3)])
    assert best < 0.05


@pytest.mark.parametrize("use_pidfd", MODES)
async def test_several_pids_each_get_their_own_callback(procs, use_pidfd: bool) -> None:
    ps = [sleeper(procs) for _ in range(3)]
    seen: list[int] = []
    done = asyncio.Event()

    def cb(pid: int) -> None:
        seen.append(pid)
        if len(seen) == 2:
            done.set()

    with ExitWatcher(use_pidfd=use_pidfd) as w:
        for p in ps:
            assert w.watch(p.pid, cb)
        ps[2].kill()
        ps[0].kill()
        await asyncio.wait_for(done.wait(), 5.0)
        await asyncio.sleep(0.25)
        assert sorted(seen) == sorted([ps[0].pid, ps[2].pid])
        assert w.watched == frozenset({ps[1].pid})


@pytest.mark.parametrize("use_pidfd", MODES)
async def test_callback_runs_once(procs, use_pidfd: bool) -> None:
    p = sleeper(procs)
    calls: list[int] = []
    with ExitWatcher(use_pidfd=use_pidfd) as w:
        w.watch(p.pid, calls.append)
        p.kill()
        await asyncio.sleep(0.5)
    assert calls == [p.pid]


@pytest.mark.parametrize("use_pidfd", MODES)
async def test_already_gone_pid_returns_false(procs, use_pidfd: bool) -> None:
    p = sleeper(procs)
    p.kill()
    p.wait()  # reaped: the pid no longer exists
    calls: list[int] = []
    with ExitWatcher(use_pidfd=use_pidfd) as w:
        assert w.watch(p.pid, calls.append) is False
        assert w.watched == frozenset()
        await asyncio.sleep(0.2)
    assert calls == []


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open")
async def test_unreaped_zombie_is_reported_at_once(procs) -> None:
    # Exited but not yet waited for (the race between exit and watch): still reported.
    p = sleeper(procs)
    p.kill()
    time.sleep(0.1)
    fired = asyncio.get_running_loop().create_future()
    with ExitWatcher() as w:
        assert w.watch(p.pid, fired.set_result)
        assert await asyncio.wait_for(fired, 1.0) == p.pid


@pytest.mark.parametrize("use_pidfd", MODES)
async def test_unwatch_prevents_the_callback(procs, use_pidfd: bool) -> None:
    p = sleeper(procs)
    calls: list[int] = []
    with ExitWatcher(use_pidfd=use_pidfd) as w:
        w.watch(p.pid, calls.append)
        w.unwatch(p.pid)
        w.unwatch(p.pid)  # twice is harmless
        w.unwatch(424242424)  # never watched: harmless
        p.kill()
        await asyncio.sleep(0.3)
    assert calls == []


@pytest.mark.parametrize("use_pidfd", MODES)
async def test_close_releases_every_fd_and_silences_callbacks(procs, use_pidfd: bool) -> None:
    before = open_fds()
    ps = [sleeper(procs) for _ in range(5)]
    after_spawn = open_fds()  # Popen may keep pipes; count only what the watcher adds
    calls: list[int] = []
    w = ExitWatcher(use_pidfd=use_pidfd)
    for p in ps:
        assert w.watch(p.pid, calls.append)
    if use_pidfd:
        assert open_fds() == after_spawn + 5
    w.close()
    assert open_fds() == after_spawn
    assert w.watched == frozenset()
    for p in ps:
        p.kill()
    await asyncio.sleep(0.3)
    assert calls == []
    with pytest.raises(RuntimeError, match="closed"):
        w.watch(ps[0].pid, calls.append)
    w.close()  # idempotent
    for p in ps:
        p.wait()
    assert open_fds() == before


async def test_fired_watch_closes_its_fd(procs) -> None:
    before = open_fds()
    with ExitWatcher() as w:
        for _ in range(5):
            await kill_and_time(w, sleeper(procs).pid, PIDFD_LIMIT_S)
        for p in procs:
            p.wait()
        assert open_fds() == before  # closed when the exit fired, not only at close()


async def test_callback_may_rewatch_another_pid(procs) -> None:
    first, second = sleeper(procs), sleeper(procs)
    got: list[int] = []
    done = asyncio.Event()

    with ExitWatcher() as w:
        def on_first(pid: int) -> None:
            got.append(pid)
            assert w.watch(second.pid, on_second)

        def on_second(pid: int) -> None:
            got.append(pid)
            done.set()

        w.watch(first.pid, on_first)
        first.kill()
        await asyncio.sleep(0.2)
        second.kill()
        await asyncio.wait_for(done.wait(), 2.0)
    assert got == [first.pid, second.pid]


async def test_watch_twice_replaces_the_callback(procs) -> None:
    p = sleeper(procs)
    a: list[int] = []
    b: list[int] = []
    with ExitWatcher() as w:
        assert w.watch(p.pid, a.append)
        assert w.watch(p.pid, b.append)
        p.kill()
        await asyncio.sleep(0.3)
    assert (a, b) == ([], [p.pid])


async def test_raising_callback_does_not_break_the_watcher(procs) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        bad, good = sleeper(procs), sleeper(procs)
        fired = loop.create_future()
        with ExitWatcher() as w:
            w.watch(bad.pid, lambda pid: 1 / 0)
            w.watch(good.pid, fired.set_result)
            bad.kill()
            await asyncio.sleep(0.2)
            good.kill()
            assert await asyncio.wait_for(fired, 2.0) == good.pid
        assert any(isinstance(e.get("exception"), ZeroDivisionError) for e in errors)
    finally:
        loop.set_exception_handler(None)


def test_python_stub_like_process(procs) -> None:
    # A python process that is not a direct child of ours, started through a shell.
    async def main() -> None:
        parent = subprocess.Popen(
            ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(30)' & echo $!; wait"],
            stdout=subprocess.PIPE, text=True)
        procs.append(parent)
        pid = int(parent.stdout.readline())
        procs.strays.append(psutil.Process(pid))
        with ExitWatcher(asyncio.get_running_loop()) as w:
            await kill_and_time(w, pid, PIDFD_LIMIT_S)

    asyncio.run(main())
