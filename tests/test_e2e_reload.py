"""`reload` re-reads the config file: every field is applied or refused (issue 9, item 1).

Three classes of field, one test each, through the real CLI on a real daemon:
- part of the launch command (model repository, tritonserver args): each instance
  runs the new command after the rolling restart, and `status` says so;
- knobs (passive-health threshold, routing policy, backoff, canary): in force at once,
  and nothing restarts;
- what needs `down`/`up` (listen addresses, GPUs, ports) and invalid values: a
  one-line error naming the field, exit 2, and nothing restarted.
"""

from __future__ import annotations

import shutil

import psutil
import pytest

from tests.harness import DEMO_REPO, triton_env

pytestmark = pytest.mark.e2e

BACKEND_ARG = "--tritonserver-arg=--backend-directory="


def _toml(values: dict) -> str:
    def show(v):
        if isinstance(v, list):
            return "[" + ", ".join(show(x) for x in v) + "]"
        return f'"{v}"' if isinstance(v, str) else str(v)
    return "".join(f"{k} = {show(v)}\n" for k, v in values.items())


@pytest.fixture
def configured(orch_run, tmp_path):
    """A daemon (2 x TP1) whose model repository and tritonserver args come from a TOML file."""
    backend_dir = triton_env()["BACKEND_DIR"]
    config = tmp_path / "orch.toml"
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2)
    base = {"tritonserver-arg": [f"--backend-directory={backend_dir}"], "outlier-failures": 5,
            "max-failures": 5}
    # The harness passes these as flags, and flags win over the file: leave them to the file.
    run.args = [a for a in run.args if not a.startswith(BACKEND_ARG)]
    for flag in ("--model-repo", "--gpus", "--base-port", "--listen"):
        i = run.args.index(flag)
        value = run.args[i + 1]
        base[flag[2:]] = int(value) if value.isdigit() else value
        del run.args[i:i + 2]
    config.write_text(_toml(base))
    run.args += ["--config", str(config)]
    run.start()
    return run, config, base


def _reload(run):
    return run.cli("reload", "--state-dir", str(run.state_dir))


def _rank_cmdlines(status: dict) -> list[str]:
    out = []
    for inst in status["instances"]:
        for pid in inst["pids"]:
            try:
                proc = psutil.Process(pid)
                if proc.name() == "tritonserver":
                    out.append(" ".join(proc.cmdline()))
            except psutil.Error:
                continue
    return out


def test_reload_relaunches_with_new_repository_and_args(configured, tmp_path):
    run, config, base = configured
    new_repo = tmp_path / "repo-v2"
    shutil.copytree(DEMO_REPO, new_repo)
    config.write_text(_toml({**base, "model-repo": str(new_repo),
                             "tritonserver-arg": [*base["tritonserver-arg"], "--exit-timeout-secs=7"]}))
    out = _reload(run)
    assert out.returncode == 0, out.stderr
    status = run.wait_for(lambda s: all(i["state"] == "READY" and i["running"].get("generation") == 2
                                        for i in s["instances"]) and not s["daemon"]["rolling_restart"],
                          120, "every instance relaunched with config generation 2")
    assert status["daemon"]["model_repo"] == str(new_repo)
    assert all(i["running"]["model_repo"] == str(new_repo) for i in status["instances"])
    cmdlines = _rank_cmdlines(status)
    assert len(cmdlines) == 2, cmdlines
    assert all(f"--model-repository={new_repo}" in c and "--exit-timeout-secs=7" in c for c in cmdlines), cmdlines


def test_reload_applies_knobs_at_once(configured):
    run, config, base = configured
    config.write_text(_toml({**base, "outlier-failures": 2, "lb-policy": "round-robin"}))
    before = run.status()
    out = _reload(run)
    assert out.returncode == 0, out.stderr
    assert "nothing restarted" in out.stdout
    status = run.status()  # at once, and without a restart (it would empty the KV caches)
    assert all(i["passive"]["eject_after"] == 2 for i in status["instances"]), status["instances"]
    assert status["daemon"]["config_generation"] == before["daemon"]["config_generation"] + 1
    assert status["daemon"]["lb_policy"] == "round-robin" and not status["daemon"]["rolling_restart"]
    assert [i["pids"] for i in status["instances"]] == [i["pids"] for i in before["instances"]]
    assert [i["restarts"] for i in status["instances"]] == [0, 0]


@pytest.mark.parametrize("change,field", [
    ({"listen": "127.0.0.1:1"}, "--listen"),
    ({"gpus": "0"}, "--gpus"),
    ({"base-port": 20000}, "--base-port"),
    ({"probe-failures": 0}, "--probe-failures"),
    ({"model-repo": "/nonexistent/repo"}, "--model-repo"),
])
def test_reload_refuses_what_it_cannot_apply(configured, change, field):
    run, config, base = configured
    before = run.status()
    config.write_text(_toml({**base, **change}))
    out = _reload(run)
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and str(list(change.values())[0]) in lines[0], lines
    after = run.status()
    assert after["daemon"]["config_generation"] == before["daemon"]["config_generation"]
    assert not after["daemon"]["rolling_restart"]
    assert [i["pids"] for i in after["instances"]] == [i["pids"] for i in before["instances"]]
    assert [i["restarts"] for i in after["instances"]] == [0, 0]
