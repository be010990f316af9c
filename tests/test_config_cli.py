"""Settings, TOML config and CLI errors: one line, exit 2, nothing started."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import Settings, build_settings
from orchestrator.errors import UsageError

REPO = Path(__file__).resolve().parent.parent


def cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=60)


@pytest.mark.unit
def test_flags_override_config(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text('gpus = "0-3"\ntp = 2\nmodel-repo = "/m"\ntensorrt_llm_model = ["a", "b"]\n')
    s = build_settings(str(conf), {"tp": "4"})
    assert (s.gpus, s.tp, s.model_repo, s.tensorrt_llm_model) == ("0-3", 4, "/m", ("a", "b"))


@pytest.mark.unit
def test_unknown_config_key_names_the_key(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text("tp = 2\ngpu = \"0\"\n")
    with pytest.raises(UsageError) as err:
        build_settings(str(conf), {})
    assert "'gpu'" in str(err.value) and "unknown key" in str(err.value)


@pytest.mark.unit
def test_config_type_error(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text('tp = "two"\n')
    with pytest.raises(UsageError, match="tp='two': expected an integer"):
        build_settings(str(conf), {})


@pytest.mark.unit
@pytest.mark.parametrize("field,value,needle", [
    ("tp", 0, "--tp=0"), ("proxy", "haproxy", "--proxy='haproxy'"), ("listen", "8080", "--listen='8080'"),
    ("lb_policy", "random", "--lb-policy"), ("probe_interval_s", -1.0, "--probe-interval-s=-1.0"),
    ("canary_body", "{", "--canary-body"),
])
def test_settings_validation(field, value, needle):
    with pytest.raises(UsageError) as err:
        Settings(**{field: value})
    assert needle in str(err.value)


@pytest.mark.e2e
@pytest.mark.parametrize("args,needle", [
    (["--gpus", "0-3", "--tp", "3", "--assume-gpus", "4"], "--tp=3"),
    (["--gpus", "0-7", "--assume-gpus", "4"], "--gpus='0-7': GPU 4,5,6,7 not on this host (it has GPUs 0-3)"),
    (["--gpus", "0,0", "--assume-gpus", "4"], "duplicate"),
    (["--gpus", "", "--assume-gpus", "4"], "empty GPU list"),
    (["--tp", "0", "--assume-gpus", "4"], "--tp=0"),
    (["--assume-gpus", "4", "--tp", "x"], "--tp='x': expected an integer"),
])
def test_up_bad_input_is_one_line_exit_2_and_starts_nothing(tmp_path, args, needle):
    state = tmp_path / "state"
    out = cli("up", "--model-repo", str(tmp_path), "--state-dir", str(state), *args)
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not state.exists() or not any(state.iterdir())


@pytest.mark.e2e
def test_up_missing_model_repo(tmp_path):
    out = cli("up", "--assume-gpus", "2", "--model-repo", str(tmp_path / "nope"), "--state-dir", str(tmp_path / "s"))
    assert out.returncode == 2 and "--model-repo=" in out.stderr and "not a directory" in out.stderr


@pytest.mark.e2e
def test_up_front_compiled_without_the_module_is_one_line_exit_2_and_starts_nothing(tmp_path):
    """--front compiled asks for the C front: on an install without it (TRTLLM_ORCH_PURE_PYTHON=1
    leaves it out, as a missing compiler does) `up` refuses, where --front auto would serve
    through aiohttp at a fraction of the rate."""
    import os
    state = tmp_path / "state"
    out = subprocess.run([sys.executable, "-m", "orchestrator", "up", "--model-repo", str(tmp_path), "--state-dir",
                          str(state), "--assume-gpus", "2", "--front", "compiled"], capture_output=True, text=True,
                         cwd=REPO, timeout=60, env={**os.environ, "TRTLLM_ORCH_PURE_PYTHON": "1"})
    assert out.returncode == 2, out.stderr
    assert "--front='compiled': the compiled front is not built here" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not state.exists() or not any(state.iterdir())


# The CLI as on a host without the NVIDIA driver, also on a GPU host: libnvidia-ml cannot
# be loaded, so pynvml's nvmlInit() fails exactly as it does there.
WITHOUT_NVML = """
import ctypes, runpy

class NoNvml(ctypes.CDLL):
    def __init__(self, name, *args, **kwargs):
        if "nvidia-ml" in str(name):
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        super().__init__(name, *args, **kwargs)

ctypes.CDLL = NoNvml  # before pynvml's `from ctypes import *`
runpy.run_module("orchestrator", run_name="__main__", alter_sys=True)
"""


@pytest.mark.e2e
def test_up_without_nvml_says_so(tmp_path):
    out = subprocess.run([sys.executable, "-c", WITHOUT_NVML, "up", "--model-repo", str(tmp_path),
                          "--state-dir", str(tmp_path / "s")], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 2, out.stderr
    assert "NVML" in out.stderr and "--assume-gpus" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.e2e
def test_up_port_taken_names_port_and_holder(tmp_path):
    import os
    import socket

    from tests.harness import triton_env
    env = triton_env()
    if env is None:
        pytest.skip("no .triton/env")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = cli("up", "--assume-gpus", "1", "--model-repo", str(tmp_path), "--state-dir", str(tmp_path / "s"),
                  "--base-port", str(port - 1), "--mpirun", env["MPIRUN"], "--tritonserver", env["TRITONSERVER"],
                  "--listen", "127.0.0.1:0", "--grpc-listen", "", "--metrics-listen", "")
    assert out.returncode == 2, out.stderr
    # The holder is this test process: the error names the port and who holds it. (The port
    # below it may be in use too, by any socket of this process: a CI run had one there.)
    assert "port(s) in use: " in out.stderr, out.stderr
    assert f"{port} (held by pid {os.getpid()} (python" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s" / "daemon.lock").exists()


@pytest.mark.e2e
def test_plan_json_for_eight_gpus():
    out = cli("plan", "--gpus", "0-7", "--tp", "2", "--assume-gpus", "8", "--model-repo", "/models/llama", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)["instances"]
    assert [i["gpus"] for i in plan] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(i["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, i["gpus"])) for i in plan)
    http = [i["ports"]["http"] for i in plan]
    assert http == [8000, 8003, 8006, 8009]


@pytest.mark.e2e
def test_unknown_flag_is_one_line():
    out = cli("up", "--gpu", "0")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
