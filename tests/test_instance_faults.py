"""The per-instance supervisor under injected OS faults, without tritonserver or mpirun.

An `OsOps` subclass makes `spawn` raise (supervisor's `fork_exception` idea): the
instance must walk STARTING -> STOPPING -> BACKOFF -> STARTING ... and end FAILED
with a reason naming the error, obey `restart` and `stop` from there, and never
spawn more than --max-failures times. Runs in well under a second per test.
"""

from __future__ import annotations

import asyncio
import errno
import os

import aiohttp
import pytest

from orchestrator.config import Settings
from orchestrator.health.exit_watch import ExitWatcher
from orchestrator.health.checks import InstanceChecks
from orchestrator.controlplane.instance import Instance, Shared
from orchestrator.launcher.group import ProcessGroup
from orchestrator.launcher.command import LaunchCommand
from orchestrator.launcher.process_tree import OsOps
from orchestrator.plan import InstancePlan, Ports
from orchestrator.controlplane.states import State
from orchestrator.controlplane.statedir import StateDir
from tests.harness import free_port_block

pytestmark = pytest.mark.unit


class SpawnFails(OsOps):
    """spawn raises OSError (EMFILE, as when the daemon ran out of file descriptors)."""

    def __init__(self) -> None:
        self.spawns = 0

    async def spawn(self, argv, env, log_fd, cwd=None):
        self.spawns += 1
        raise OSError(errno.EMFILE, "Too many open files (injected)")


class Harness:
    def __init__(self, tmp_path, ops: OsOps, **settings):
        self.ops = ops
        self.settings = Settings(gpus="0-1", tp=2, model_repo=str(tmp_path), max_failures=3,
                                 backoff_initial_s=0.01, backoff_max_s=0.05, failure_window_s=60,
                                 stop_grace_s=0.5, **settings)
        base = free_port_block(3)
        self.plan = InstancePlan("0", (0, 1), Ports(base, base + 1, base + 2), "127.0.0.1")
        self.state_dir = StateDir(tmp_path / "state")
        self.state_dir.ensure()
        self.moves: list[tuple[State, str]] = []

    async def __aenter__(self) -> "Harness":
        self.session = aiohttp.ClientSession()
        self.watcher = ExitWatcher(asyncio.get_running_loop())
        root = str(self.state_dir.root)
        shared = Shared(self.settings, self.state_dir, lambda plan: LaunchCommand(("/bin/true",), {}),
                        lambda plan, log, trouble: ProcessGroup(plan, root, self.ops, self.watcher, None,
                                                                log, trouble),
                        lambda backend: InstanceChecks(self.session, backend.http_url))
        self.inst = Instance(self.plan, shared, lambda i: self.moves.append((i.state, i.reason)))
        self.task = asyncio.create_task(self.inst.supervise())
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.task.done():
            self.inst.request_stop()
            await asyncio.wait_for(self.task, 10)
        await self.session.close()
        self.watcher.close()

    def states(self) -> list[State]:
        # on_change also fires for pid updates; keep state changes only.
        out: list[State] = []
        for state, _ in self.moves:
            if not out or out[-1] != state:
                out.append(state)
        return out

    async def until(self, predicate, timeout: float = 10.0) -> None:
        async def poll() -> None:
            while not predicate():
                await asyncio.sleep(0.005)
        await asyncio.wait_for(poll(), timeout)  # not asyncio.timeout: Python 3.10


FAILED_PATH = [State.STARTING, State.STOPPING, State.BACKOFF,
               State.STARTING, State.STOPPING, State.BACKOFF,
               State.STARTING, State.STOPPING, State.FAILED]


async def test_spawn_failure_backs_off_then_fails_with_reason(tmp_path):
    async with Harness(tmp_path, SpawnFails()) as h:
        await h.until(lambda: h.inst.state == State.FAILED)
        await asyncio.sleep(0.1)  # nothing more may happen on its own once FAILED
        assert h.states() == FAILED_PATH
        assert h.ops.spawns == 3
        assert h.inst.restarts == 2
        assert "3 failures within 60s: giving up" in h.inst.reason
        assert "could not start /bin/true" in h.inst.reason and "Too many open files" in h.inst.reason
        assert h.inst.last_failure.startswith("could not start /bin/true: [Errno 24]")
        # Every BACKOFF says why and when the next try comes.
        backoffs = [reason for state, reason in h.moves if state == State.BACKOFF]
        assert backoffs[0].endswith("1st failure in 60s: restarting now"), backoffs
        assert "2nd failure in 60s: restarting in" in backoffs[1], backoffs
        assert all("Too many open files" in r for r in backoffs)
        status = h.inst.describe()
        assert status["state"] == "FAILED" and status["mpirun_pid"] is None and status["pids"] == []


async def test_restart_from_failed_gets_a_fresh_budget(tmp_path):
    async with Harness(tmp_path, SpawnFails()) as h:
        await h.until(lambda: h.inst.state == State.FAILED)
        n = len(h.states())
        h.inst.request_restart()  # `trtllm-orch restart 0`
        await h.until(lambda: h.inst.state == State.FAILED and len(h.states()) > n)
        assert h.states()[n - 1:] == [State.FAILED, *FAILED_PATH]
        assert h.ops.spawns == 6  # the operator's restart forgave the earlier 3
        first_failed = next(i for i, (state, _) in enumerate(h.moves) if state == State.FAILED)
        restarted = next(m for m in h.moves[first_failed:] if m[0] == State.STARTING)
        assert restarted[1] == "restart requested"
        h.inst.request_stop()
        await asyncio.wait_for(h.task, 5)
        assert h.inst.state == State.STOPPED


async def test_stop_during_backoff_needs_no_kill(tmp_path):
    # A long backoff after the 2nd failure: the stop must end it at once, BACKOFF -> STOPPED.
    async with Harness(tmp_path, SpawnFails(), stable_after_s=60) as h:
        h.inst.policy.initial_s = h.inst.policy.cap_s = 30.0
        await h.until(lambda: h.inst.state == State.BACKOFF and h.ops.spawns == 2)
        h.inst.request_stop()
        await asyncio.wait_for(h.task, 2)
        assert h.states()[-2:] == [State.BACKOFF, State.STOPPED]
        assert h.inst.reason == "stopped during backoff"
        assert h.ops.spawns == 2


def test_a_group_starts_with_a_home_even_when_the_daemon_has_none():
    # systemd starts a root service without HOME; Open MPI's mpirun cannot start without one.
    from orchestrator.launcher.group import spawn_env
    env = spawn_env({"PATH": "/bin", "NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1"}, {"TMPDIR": "/t"})
    assert env["PATH"] == "/bin" and env["TMPDIR"] == "/t" and "NOTIFY_SOCKET" not in env
    assert env["HOME"] and os.path.isabs(env["HOME"])
    assert spawn_env({"HOME": "/home/me"}, {})["HOME"] == "/home/me"
