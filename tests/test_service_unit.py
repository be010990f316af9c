"""The systemd unit: rendering, escaping, installing, and `systemd-analyze verify`."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from orchestrator.errors import UsageError
from orchestrator.service.unit import install_unit, quote_exec_arg, render_unit

ANALYZE = shutil.which("systemd-analyze")


def fake_exe(tmp_path: Path) -> str:
    exe = tmp_path / "bin" / "trtllm-orch"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return str(exe)


def keys(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def sections(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    name = ""
    for line in text.splitlines():
        if line.startswith("["):
            name = line.strip("[]")
            out[name] = ""
        elif name:
            out[name] += line + "\n"
    return out


@pytest.mark.unit
def test_unit_fields(tmp_path: Path) -> None:
    exe = fake_exe(tmp_path)
    text = render_unit(tmp_path / "orch.toml", exe, "/run/trtllm-orch", {"MODEL": "llama"}, None)
    k = keys(text)
    assert k["Type"] == ["notify"] and k["NotifyAccess"] == ["main"]
    assert k["ExecStart"] == [f"{exe} up --config {tmp_path}/orch.toml"]
    assert k["ExecReload"] == [f"{exe} reload --state-dir /run/trtllm-orch"]
    assert "ExecStop" not in k and "User" not in k
    for key, value in (("Restart", "on-failure"), ("RestartSec", "5"), ("WatchdogSec", "30"),
                       ("TimeoutStartSec", "1800"), ("KillMode", "process"), ("RuntimeDirectory", "trtllm-orch"),
                       ("RuntimeDirectoryMode", "0700"), ("LimitMEMLOCK", "infinity"),
                       ("LimitSTACK", "67108864"), ("Wants", "network-online.target"),
                       ("After", "network-online.target nvidia-persistenced.service"),
                       ("WantedBy", "multi-user.target")):
        assert k[key] == [value], key
    assert int(k["TimeoutStopSec"][0]) > 3 * 10
    assert k["Environment"] == ['"MODEL=llama"']
    unit = sections(text)["Unit"]
    assert "StartLimitIntervalSec=300" in unit and "StartLimitBurst=5" in unit
    assert "Type=notify" in sections(text)["Service"]


@pytest.mark.unit
def test_timeout_stop_outlasts_grace(tmp_path: Path) -> None:
    text = render_unit(tmp_path / "c.toml", fake_exe(tmp_path), "/run/trtllm-orch", {}, None, stop_grace_s=60)
    assert int(keys(text)["TimeoutStopSec"][0]) > 3 * 60


@pytest.mark.unit
def test_escaping(tmp_path: Path) -> None:
    assert quote_exec_arg("/a/b.toml") == "/a/b.toml"
    assert quote_exec_arg("/my dir/100%.toml") == '"/my dir/100%%.toml"'
    assert quote_exec_arg("$HOME") == '"$$HOME"'
    assert quote_exec_arg('a"b\\c') == '"a\\"b\\\\c"'
    text = render_unit(Path("/etc/my orch/c.toml"), fake_exe(tmp_path), "/run/trtllm-orch",
                       {"B": 'say "hi" 50%', "A": "x y"}, None)
    k = keys(text)
    assert k["ExecStart"][0].endswith(' up --config "/etc/my orch/c.toml"')
    assert k["Environment"] == ['"A=x y"', '"B=say \\"hi\\" 50%%"']


@pytest.mark.unit
@pytest.mark.parametrize("bad", [
    dict(environment={"BAD NAME": "x"}),
    dict(environment={"A": "line1\nline2"}),
    dict(exe="relative/trtllm-orch"),
    dict(user="root\nExecStartPre=/bin/evil"),
])
def test_refuses_what_systemd_cannot_carry(tmp_path: Path, bad: dict) -> None:
    args = dict(config_path=tmp_path / "c.toml", exe=fake_exe(tmp_path), state_dir="/run/trtllm-orch",
                environment={}, user=None)
    args.update(bad)
    with pytest.raises(UsageError):
        render_unit(**args)


@pytest.mark.unit
def test_install_unit_is_atomic_and_readable(tmp_path: Path) -> None:
    text = render_unit(tmp_path / "c.toml", fake_exe(tmp_path), "/run/trtllm-orch", {}, None)
    path = install_unit(text, tmp_path / "units")
    assert path == tmp_path / "units" / "trtllm-orch.service"
    assert path.read_text() == text
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    install_unit(text.replace("RestartSec=5", "RestartSec=6"), tmp_path / "units")
    assert "RestartSec=6" in path.read_text()
    assert sorted(p.name for p in (tmp_path / "units").iterdir()) == ["trtllm-orch.service"]
    with pytest.raises(UsageError):
        install_unit(text, tmp_path / "units", name="../evil")


@pytest.mark.process
@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("with_user", [False, True])
def test_systemd_analyze_verify(tmp_path: Path, with_user: bool) -> None:
    exe = fake_exe(tmp_path / "my dir")  # a space in the path exercises the quoting
    config = tmp_path / "orch.toml"
    config.write_text("")
    user = pwd.getpwuid(os.getuid()).pw_name if with_user else None
    text = render_unit(config, exe, "/run/trtllm-orch", {"TRTLLM_MODEL": "llama 3", "PCT": "50%"}, user)
    path = install_unit(text, tmp_path / "units")
    result = subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"})
    problems = [ln for ln in (result.stdout + result.stderr).splitlines()
                if "trtllm-orch.service" in ln or "Unknown" in ln or "rror" in ln]
    assert result.returncode == 0, result.stdout + result.stderr
    assert problems == [], problems


@pytest.mark.unit
def test_the_daemon_tells_a_restart_job_from_a_stop():
    from orchestrator.service.systemd_job import own_unit, restart_job_for
    v1 = "12:pids:/system.slice/trtllm-orch.service\n1:name=systemd:/system.slice/trtllm-orch.service\n"
    v2 = "0::/system.slice/trtllm-orch.service\n"
    assert own_unit(v1) == own_unit(v2) == "trtllm-orch.service"
    assert own_unit("0::/user.slice/user-0.slice/session-1.scope\n") is None
    jobs = "1234 trtllm-orch.service restart running\n99 other.service start waiting\n"
    assert restart_job_for("trtllm-orch.service", jobs)
    assert not restart_job_for("trtllm-orch.service", "1234 trtllm-orch.service stop running\n")
    assert not restart_job_for("trtllm-orch.service", "99 other.service restart running\n")
