"""Test layers, and the fixture for real daemon runs.

Every test carries exactly one layer marker (setup.cfg registers them):
  unit     no child process, no socket beyond in-process loopback   scripts/test -m unit
  process  real child processes started by library code (tritonserver, mpirun,
           nginx, systemd-analyze, sleep)                            scripts/test -m process
  e2e      the trtllm-orch CLI as a user runs it (the daemon through the CLI)   scripts/test -m e2e
A test without one (or with two) stops the run at collection; a `unit` test that
starts a process fails.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.harness import Run, triton_env

LAYERS = ("unit", "process", "e2e")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything: every collected test is checked
def pytest_collection_modifyitems(config, items):
    wrong = []
    for item in items:
        layers = sorted({m.name for m in item.iter_markers() if m.name in LAYERS})
        if len(layers) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(layers) or 'none'}")
    if wrong:
        raise pytest.UsageError(
            "every test needs exactly one layer marker (pytestmark = pytest.mark.unit | process | e2e, "
            "or @pytest.mark.<layer> per test; see tests/conftest.py):\n" + "\n".join(wrong))


class UnitTestSpawned(Exception):
    """A test marked `unit` tried to start a process (not an OSError, so no spawn-failure path eats it)."""


_SPAWNERS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen")


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A `unit` test that starts a child process fails (subprocess, asyncio's subprocesses, os.fork...)."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    attempts: list[str] = []

    def refuse(what: str, argv_at: int):
        def spawn(*args, **kwargs):
            attempts.append(f"{what}({args[argv_at] if len(args) > argv_at else ''!r})")
            raise UnitTestSpawned(f"a unit test may not start a process: {attempts[-1]} "
                                  "(mark the test `process`, or replace the OS call with a fake)")
        return spawn

    # _execute_child(self, args, ...): every Popen goes through it, asyncio.create_subprocess_* too.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse("subprocess.Popen", 1))
    for name in _SPAWNERS:
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"os.{name}", 0))
    yield
    if attempts and not getattr(request.node, "_call_failed", False):  # the code under test ate the error
        pytest.fail(f"unit test tried to start a process: {attempts}", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call":
        item._call_failed = outcome.get_result().failed


@pytest.fixture
def orch_run(tmp_path):
    """Factory for real daemon runs; every run is torn down and checked for leaks."""
    if triton_env() is None:
        pytest.skip("no .triton/env: run scripts/setup-triton (the README's test command does)")
    runs: list[Run] = []

    def make(**kwargs) -> Run:
        run = Run(tmp_path / f"run{len(runs)}", **kwargs)
        (tmp_path / f"run{len(runs)}").mkdir(exist_ok=True)
        runs.append(run)
        return run

    yield make
    leaks = {str(r.state_dir): r.close() for r in runs}
    assert not any(leaks.values()), f"processes left running after the test: {leaks}"
