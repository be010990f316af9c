"""End-to-end tests of the embedded gRPC load balancer against two real tritonservers.

The servers (pytriton's tritonserver binary, Python backend) start once per session
on loopback and serve a tiny repository made here: `echo` (unary, optional delay)
and `countdown` (decoupled, streams N responses). Each test gets its own proxy and
ready set; per-instance traffic is checked with ModelStatistics asked of each server
DIRECTLY, never through the proxy.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import grpc.aio
import numpy as np
import pytest

from orchestrator.config import Settings
from orchestrator.errors import OrchError
from orchestrator.routing.backends import Backend, ReadyBackends
from orchestrator.routing.balancer import DEFAULT_COOLDOWN_S
from tests.fakes import RecordingBackends
from tests.harness import free_port, free_port_block
from orchestrator.dataplane.grpc_proxy import GrpcProxy

tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
import tritonclient.grpc.aio as grpcclient_aio  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

try:
    import pytriton
    PYTRITON = Path(pytriton.__file__).parent / "tritonserver"
except ImportError:  # pragma: no cover
    PYTRITON = None

ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "DELAY_MS" data_type: TYPE_INT32 dims: [ 1 ] optional: true }
]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

# The stub embeds Python with the environment ignored (PYTHONPATH is in os.environ
# but not on sys.path), so the models put it there before importing numpy.
SYS_PATH_FIX = """
import os, sys
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
"""

ECHO_MODEL = SYS_PATH_FIX + """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            delay = pb_utils.get_input_tensor_by_name(request, "DELAY_MS")
            if delay is not None:
                time.sleep(int(delay.as_numpy()[0]) / 1000.0)
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
        return responses
"""

COUNTDOWN_CONFIG = """
name: "countdown"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

COUNTDOWN_MODEL = SYS_PATH_FIX + """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                out = pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


class Reaper:
    """Kills the servers' process groups even when pytest itself is killed (-9, a CI
    timeout) and no teardown runs: a sidecar in its own session waits for its stdin
    to close, which happens however pytest ends. A server's Python stubs outlive a
    server killed alone (seen here: orphaned, still running after 20 s), so it is
    the group that goes."""

    CODE = ("import os, signal, sys\n"
            "groups = [int(line) for line in sys.stdin]\n"
            "for g in groups:\n"
            "    try: os.killpg(g, signal.SIGKILL)\n"
            "    except OSError: pass\n")

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], stdin=subprocess.PIPE,
                                     start_new_session=True)

    def watch(self, pgid: int) -> None:
        self.proc.stdin.write(f"{pgid}\n".encode())
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


REPO = Path(__file__).resolve().parent.parent
TRITON_ENV = REPO / ".triton" / "env"  # written by scripts/setup-triton
DEMO_REPO = REPO / "demo" / "model_repo"


class Setup:
    """How to run tritonserver here: scripts/setup-triton's prepared backend directory
    and the shared demo repository when they exist, else a copy of pytriton's Python
    backend made here (and no demo model)."""

    def __init__(self, root: Path) -> None:
        self.repos = [make_models(root / "models")]
        self.models = ["echo", "countdown"]
        values = read_env_file(TRITON_ENV) if TRITON_ENV.exists() else {}
        if values.get("TRITONSERVER") and values.get("BACKEND_DIR"):
            self.binary = values["TRITONSERVER"]
            self.backends = Path(values["BACKEND_DIR"])
            self.env = {k: values[k] for k in ("PYTHONPATH", "LD_LIBRARY_PATH") if k in values}
            if (DEMO_REPO / "tensorrt_llm" / "config.pbtxt").exists():
                self.repos.append(DEMO_REPO)
                self.models.append("tensorrt_llm")
        else:
            self.binary = str(PYTRITON / "bin" / "tritonserver")
            self.backends = copy_python_backend(root / "backends")
            # The copied stub finds its bundled libraries through an $ORIGIN-relative
            # RPATH that no longer points anywhere.
            self.env = {"PYTHONPATH": str(Path(np.__file__).parent.parent),
                        "LD_LIBRARY_PATH": str(PYTRITON.parent.parent / "nvidia_pytriton.libs")}


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip().strip("\"'")
    return out


def make_models(repo: Path) -> Path:
    for name, config, model in (("echo", ECHO_CONFIG, ECHO_MODEL),
                                ("countdown", COUNTDOWN_CONFIG, COUNTDOWN_MODEL)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(model)
    return repo


def copy_python_backend(backends: Path) -> Path:
    (backends / "python").mkdir(parents=True)
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    for src in (PYTRITON / "python_backend_stubs" / py / "triton_python_backend_stub",
                PYTRITON / "backends" / "python" / "libtriton_python.so",
                PYTRITON / "backends" / "python" / "triton_python_backend_utils.py"):
        shutil.copy2(src, backends / "python" / src.name)
    return backends


_HANDED: set[int] = set()  # the servers' ports handed out in this process


def _server_ports() -> tuple[int, int, int]:
    """Three ports no other server of this process was given, bind-tested below the ephemeral range.
    Three bind(0) picks can repeat a port (the kernel hands a released one out again): one CI run's
    servers got the same gRPC and metrics port and exited ("cannot listen to GRPC requests and
    metrics requests at the same address"), failing 14 tests at setup."""
    while True:
        base = free_port_block(3)
        ports = (base, base + 1, base + 2)
        if not _HANDED.intersection(ports):
            _HANDED.update(ports)
            return ports


class Triton:
    """One tritonserver process in its own process group (killed as a group)."""

    def __init__(self, name: str, setup: Setup, log: Path, reaper: "Reaper") -> None:
        self.name = name
        self.models = setup.models
        self.http, self.grpc, self.metrics = _server_ports()
        env = dict(os.environ)
        for key, value in setup.env.items():
            env[key] = value + os.pathsep + env[key] if env.get(key) else value
        env["DEMO_TOKEN_DELAY_MS"] = "5"
        self.log = log
        self.shm_prefix = f"gp{name}_{os.getpid()}_"
        self.proc = subprocess.Popen(
            [setup.binary, *(f"--model-repository={r}" for r in setup.repos),
             f"--backend-directory={setup.backends}", "--model-control-mode=explicit",
             *(f"--load-model={m}" for m in setup.models),
             "--http-address=127.0.0.1", f"--http-port={self.http}",
             "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc}",
             "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics}",
             # Distinct shm prefixes: two servers on one host must not share regions.
             f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
             "--log-verbose=0"],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        reaper.watch(self.proc.pid)
        self.backend = Backend(name, "127.0.0.1", self.http, self.grpc, self.metrics)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        client = tritonclient_grpc.InferenceServerClient(self.target)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tritonserver {self.name} exited {self.proc.returncode}:\n"
                                       + self.log.read_text()[-3000:])
                try:
                    if client.is_server_ready() and all(map(client.is_model_ready, self.models)):
                        return
                except InferenceServerException:
                    pass
                time.sleep(0.2)
            raise RuntimeError(f"tritonserver {self.name} not ready:\n" + self.log.read_text()[-3000:])
        finally:
            client.close()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its Python stubs
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        # SIGKILLed stubs leave their regions in /dev/shm (RAM), as the launcher knows (group.py)
        for path in Path("/dev/shm").glob(self.shm_prefix + "*"):
            path.unlink(missing_ok=True)

    def success_count(self, model: str) -> int:
        client = tritonclient_grpc.InferenceServerClient(self.target)
        try:
            stats = client.get_inference_statistics(model_name=model)
            return sum(s.inference_stats.success.count for s in stats.model_stats)
        finally:
            client.close()


def echo_counts(servers: list[Triton]) -> list[int]:
    """Per-server echo successes, once they stop moving (Triton counts a request
    after its response went out, so a read right after a call can lag by one)."""
    last = None
    for _ in range(50):
        now = [s.success_count("echo") for s in servers]
        if now == last:
            return now
        last = now
        time.sleep(0.05)
    return last


@pytest.fixture(scope="session")
def tritons(tmp_path_factory):
    if PYTRITON is None or not (PYTRITON / "bin" / "tritonserver").exists():
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    root = tmp_path_factory.mktemp("triton")
    setup = Setup(root)
    reaper = Reaper()
    servers: list[Triton] = []
    try:
        for name in ("0", "1"):
            servers.append(Triton(name, setup, root / f"triton{name}.log", reaper))
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.kill()
        reaper.close()


def settings(**changes) -> Settings:
    return Settings(grpc_listen="127.0.0.1:0", **changes)


class Sinks:
    """What the proxy reported to each instance's passive health (see RecordingBackends)."""

    def __init__(self, ready: RecordingBackends) -> None:
        self.failures = ready.failures
        self.successes = ready.successes


@pytest.fixture
async def proxy_factory():
    made: list[GrpcProxy] = []

    async def make(backends: tuple[Backend, ...], **changes) -> tuple[GrpcProxy, ReadyBackends]:
        ready = RecordingBackends()
        ready.publish(backends)
        proxy = GrpcProxy(settings(**changes), ready)
        await proxy.start()
        made.append(proxy)
        return proxy, ready

    yield make
    for p in made:
        await p.stop(0.5)


def client_for(proxy: GrpcProxy) -> grpcclient_aio.InferenceServerClient:
    return grpcclient_aio.InferenceServerClient(f"127.0.0.1:{proxy.bound_port}")


def echo_inputs(values, delay_ms: int | None = None):
    data = np.asarray(values, dtype=np.float32)
    x = grpcclient_aio.InferInput("INPUT0", list(data.shape), "FP32")
    x.set_data_from_numpy(data)
    inputs = [x]
    if delay_ms is not None:
        d = grpcclient_aio.InferInput("DELAY_MS", [1], "INT32")
        d.set_data_from_numpy(np.array([delay_ms], dtype=np.int32))
        inputs.append(d)
    return inputs


def countdown_request(request_id: str, n: int) -> dict:
    x = grpcclient_aio.InferInput("N", [1], "INT32")
    x.set_data_from_numpy(np.array([n], dtype=np.int32))
    return {"model_name": "countdown", "inputs": [x], "request_id": request_id}


def dead_backend() -> Backend:
    # A port nobody listens on: connection refused.
    return Backend("9", "127.0.0.1", free_port(), free_port(), free_port())


# --- tests ------------------------------------------------------------------------

@pytest.mark.process
async def test_unary_infer_spreads_over_both_instances(tritons, proxy_factory):
    a, b = tritons
    proxy, ready = await proxy_factory((a.backend, b.backend))
    client = client_for(proxy)
    try:
        # Both upstream channels connected first: a connect that times out on a loaded machine
        # cools that instance down for a second (Balancer.connect_failed), and calls made
        # meanwhile rightly go to the other one (a CI run saw 4 and 36; cause not proven).
        await asyncio.gather(*(client.infer("echo", echo_inputs([0.0], delay_ms=50)) for _ in range(4)))
        await asyncio.sleep(DEFAULT_COOLDOWN_S + 0.1)
        sinks = Sinks(ready)
        answered_before, failed_before = len(sinks.successes), len(sinks.failures)
        before = echo_counts(tritons)
        # Concurrent calls: least-outstanding must use both instances. Each is held 100 ms
        # there, so they overlap however slowly a loaded machine issues them.
        results = await asyncio.gather(*(client.infer("echo", echo_inputs([i, i + 0.5], delay_ms=100))
                                         for i in range(40)))
    finally:
        await client.close()
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.array([i, i + 0.5], np.float32))
    gained = [x - y for x, y in zip(echo_counts(tritons), before)]
    assert sum(gained) == 40
    assert min(gained) >= 5, gained
    assert proxy.inflight() == {"0": 0, "1": 0}
    assert len(sinks.failures) == failed_before and len(sinks.successes) - answered_before == 40


@pytest.mark.process
async def test_round_robin_alternates(tritons, proxy_factory):
    proxy, _ = await proxy_factory(tuple(t.backend for t in tritons), lb_policy="round-robin")
    before = echo_counts(tritons)
    client = client_for(proxy)
    try:
        for i in range(10):  # sequential: least-outstanding would see only ties here
            await client.infer("echo", echo_inputs([i]))
    finally:
        await client.close()
    assert [x - y for x, y in zip(echo_counts(tritons), before)] == [5, 5]


@pytest.mark.process
async def test_stream_infer_receives_every_response(tritons, proxy_factory):
    proxy, _ = await proxy_factory(tuple(t.backend for t in tritons))
    client = client_for(proxy)
    counts = {"a": 7, "b": 3, "c": 12}
    received: dict[str, list[int]] = {k: [] for k in counts}
    all_done = asyncio.Event()

    async def requests():
        for rid, n in counts.items():
            yield countdown_request(rid, n)
        await all_done.wait()  # keep the stream open until every response arrived

    try:
        # The aio client ignores enable_empty_final_response: count responses instead.
        async def receive() -> None:
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                received[result.get_response().id].append(int(result.as_numpy("OUT")[0]))
                if sum(map(len, received.values())) == sum(counts.values()):
                    all_done.set()
        await asyncio.wait_for(receive(), 30)  # not asyncio.timeout: Python 3.10
    finally:
        await client.close()
    assert received == {k: list(range(n)) for k, n in counts.items()}
    assert sum(proxy.inflight().values()) == 0


@pytest.mark.process
async def test_demo_tensorrt_llm_stream_with_sync_client(tritons, proxy_factory):
    """The shared demo model (decoupled, TRT-LLM tensor names) through the proxy, with
    tritonclient's sync streaming API (its own thread, so the proxy's loop runs free)."""
    if "tensorrt_llm" not in tritons[0].models:
        pytest.skip("no .triton/env + demo/model_repo (scripts/setup-triton)")
    import queue

    proxy, _ = await proxy_factory(tuple(t.backend for t in tritons))
    prompt = list(b"grpc via proxy")

    def run() -> list[list[int]]:
        ids = np.array([prompt], dtype=np.int32)
        inputs = []
        for name, arr in (("input_ids", ids),
                          ("input_lengths", np.array([[ids.shape[1]]], dtype=np.int32)),
                          ("request_output_len", np.array([[6]], dtype=np.int32)),
                          ("streaming", np.array([[True]], dtype=bool))):
            t = tritonclient_grpc.InferInput(name, list(arr.shape), "BOOL" if arr.dtype == bool else "INT32")
            t.set_data_from_numpy(arr)
            inputs.append(t)
        results: queue.Queue = queue.Queue()
        client = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{proxy.bound_port}")
        streams = []
        try:
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            for rid in ("r1", "r2"):  # two requests on one stream
                client.async_stream_infer("tensorrt_llm", inputs, request_id=rid,
                                          enable_empty_final_response=True)
            tokens: dict[str, list[int]] = {"r1": [], "r2": []}
            finals = 0
            while finals < 2:
                result, error = results.get(timeout=20)
                assert error is None, error
                response = result.get_response()
                if response.parameters["triton_final_response"].bool_param:
                    finals += 1
                if result.as_numpy("output_ids") is not None:
                    tokens[response.id] += result.as_numpy("output_ids").reshape(-1).tolist()
            streams = [tokens["r1"], tokens["r2"]]
        finally:
            client.stop_stream()
            client.close()
        return streams

    r1, r2 = await asyncio.to_thread(run)
    assert len(r1) == 6 and r1 == r2  # deterministic: the same prompt, the same tokens


@pytest.mark.process
async def test_admin_rpc_refused_and_model_stays_loaded(tritons, proxy_factory):
    proxy, _ = await proxy_factory(tuple(t.backend for t in tritons))
    client = client_for(proxy)
    try:
        for call in (client.unload_model("echo"), client.get_model_repository_index(),
                     client.get_inference_statistics("echo"), client.get_model_config("echo")):
            with pytest.raises(InferenceServerException) as exc:
                await call
            assert exc.value.status() == "StatusCode.PERMISSION_DENIED"
        assert await client.is_model_ready("echo")
    finally:
        await client.close()
    for t in tritons:
        direct = tritonclient_grpc.InferenceServerClient(t.target)
        try:
            assert direct.is_model_ready("echo")
        finally:
            direct.close()


@pytest.mark.process
async def test_admin_rpc_allowed_with_allow_admin(tritons, proxy_factory):
    proxy, _ = await proxy_factory((tritons[0].backend,), allow_admin=True)
    client = client_for(proxy)
    try:
        stats = await client.get_inference_statistics("echo")
        assert stats.model_stats[0].name == "echo"
    finally:
        await client.close()


@pytest.mark.process
async def test_unknown_method_unimplemented(tritons, proxy_factory):
    proxy, _ = await proxy_factory(tuple(t.backend for t in tritons))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
        for method in ("/inference.GRPCInferenceService/NoSuchMethod", "/other.Service/ServerLive"):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await ch.unary_unary(method)(b"")
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.unit
async def test_no_ready_backend(proxy_factory):
    proxy, _ = await proxy_factory((), hold_s=0.3)  # the hold itself is tested elsewhere
    client = client_for(proxy)
    try:
        with pytest.raises(InferenceServerException) as exc:
            await client.infer("echo", echo_inputs([1.0]))
        assert exc.value.status() == "StatusCode.UNAVAILABLE"
        assert "no ready instance" in exc.value.message()
        with pytest.raises(InferenceServerException) as exc:
            await client.get_server_metadata()
        assert exc.value.status() == "StatusCode.UNAVAILABLE"
        # The proxy answers these itself: it is alive, and honestly not ready.
        assert await client.is_server_ready() is False
        assert await client.is_server_live() is True
    finally:
        await client.close()


@pytest.mark.process
async def test_backend_removed_from_ready_set(tritons, proxy_factory):
    a, b = tritons
    proxy, ready = await proxy_factory((a.backend, b.backend))
    client = client_for(proxy)
    try:
        await asyncio.gather(*(client.infer("echo", echo_inputs([1.0])) for _ in range(4)))
        ready.publish((b.backend,))
        before = echo_counts(tritons)
        await asyncio.gather(*(client.infer("echo", echo_inputs([2.0])) for _ in range(20)))
        assert [x - y for x, y in zip(echo_counts(tritons), before)] == [0, 20]
        assert set(proxy.inflight()) == {"1"}
        ready.publish(())
        with pytest.raises(InferenceServerException) as exc:
            await client.infer("echo", echo_inputs([3.0]))
        assert exc.value.status() == "StatusCode.UNAVAILABLE"
        ready.publish((a.backend,))  # back: a fresh channel is made on demand
        await client.infer("echo", echo_inputs([4.0]))
    finally:
        await client.close()


@pytest.mark.process
@pytest.mark.parametrize("policy", ["least-outstanding", "round-robin"])
async def test_retry_when_ready_backend_is_down(tritons, proxy_factory, policy):
    dead = dead_backend()
    proxy, ready = await proxy_factory((dead, tritons[1].backend), lb_policy=policy)
    sinks = Sinks(ready)
    client = client_for(proxy)
    try:
        for i in range(20):  # random ties: the dead one is picked (1 - 2**-20)
            r = await client.infer("echo", echo_inputs([float(i)]))
            assert r.as_numpy("OUTPUT0")[0] == i
        assert await client.is_server_ready() is True
        assert await client.get_server_metadata()
    finally:
        await client.close()
    assert sinks.failures and {i for i, _ in sinks.failures} == {"9"}
    assert "9" not in sinks.successes


@pytest.mark.process
async def test_stream_retried_before_first_response(tritons, proxy_factory):
    proxy, ready = await proxy_factory((dead_backend(), tritons[0].backend), lb_policy="round-robin")
    sinks = Sinks(ready)
    for _ in range(2):  # round robin: one of the two streams starts on the dead instance
        client = client_for(proxy)
        done = asyncio.Event()

        async def requests():
            yield countdown_request("r", 4)
            await done.wait()

        got = []
        try:
            async def receive() -> None:
                async for result, error in client.stream_infer(requests()):
                    assert error is None, error
                    got.append(int(result.as_numpy("OUT")[0]))
                    if len(got) == 4:
                        done.set()
            await asyncio.wait_for(receive(), 30)  # not asyncio.timeout: Python 3.10
        finally:
            await client.close()
        assert got == [0, 1, 2, 3]
    assert {i for i, _ in sinks.failures} == {"9"}


@pytest.mark.unit
async def test_all_backends_down_returns_upstream_unavailable(proxy_factory):
    proxy, ready = await proxy_factory((dead_backend(),), max_attempts=2)
    sinks = Sinks(ready)
    client = client_for(proxy)
    try:
        with pytest.raises(InferenceServerException) as exc:
            await client.infer("echo", echo_inputs([1.0]))
        assert exc.value.status() == "StatusCode.UNAVAILABLE"
        assert await client.is_server_ready() is False
    finally:
        await client.close()
    assert sinks.failures


@pytest.mark.process
async def test_upstream_error_passed_through_unchanged(tritons, proxy_factory):
    proxy, _ = await proxy_factory((tritons[0].backend,))
    bad = grpcclient_aio.InferInput("INPUT0", [2], "INT32")  # the model wants FP32
    bad.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
    direct = grpcclient_aio.InferenceServerClient(tritons[0].target)
    client = client_for(proxy)
    try:
        with pytest.raises(InferenceServerException) as want:
            await direct.infer("echo", [bad])
        with pytest.raises(InferenceServerException) as got:
            await client.infer("echo", [bad])
    finally:
        await client.close()
        await direct.close()
    assert got.value.status() == want.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert got.value.message() == want.value.message()


@pytest.mark.process
async def test_deadline_and_cancellation_reach_upstream(tritons, proxy_factory):
    proxy, _ = await proxy_factory((tritons[0].backend,))
    client = client_for(proxy)
    try:
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as exc:
            await client.infer("echo", echo_inputs([1.0], delay_ms=3000), client_timeout=0.3)
        assert exc.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert time.monotonic() - started < 2.0
        # The client's cancel must release the upstream call, not leave it counted.
        for _ in range(50):
            if proxy.inflight()["0"] == 0:
                break
            await asyncio.sleep(0.02)
        assert proxy.inflight()["0"] == 0

        task = asyncio.ensure_future(client.infer("echo", echo_inputs([1.0], delay_ms=3000)))
        for _ in range(100):
            if proxy.inflight()["0"] == 1:
                break
            await asyncio.sleep(0.02)
        assert proxy.inflight()["0"] == 1
        task.cancel()
        with pytest.raises((asyncio.CancelledError, InferenceServerException)):
            await task
        for _ in range(100):
            if proxy.inflight()["0"] == 0:
                break
            await asyncio.sleep(0.02)
        assert proxy.inflight()["0"] == 0
    finally:
        await client.close()


@pytest.mark.process
async def test_metadata_forwarded(tritons, proxy_factory):
    proxy, _ = await proxy_factory((tritons[0].backend,))
    client = client_for(proxy)
    try:
        md = await client.get_model_metadata("echo", headers={"x-request-tag": "abc"})
        assert md.name == "echo"
    finally:
        await client.close()


@pytest.mark.unit
async def test_bind_failure_names_the_address(proxy_factory):
    proxy, _ = await proxy_factory(())
    taken = f"127.0.0.1:{proxy.bound_port}"
    other = GrpcProxy(Settings(grpc_listen=taken), ReadyBackends())
    with pytest.raises(OrchError, match=taken):
        await other.start()


# --- fault injection with in-process fake upstreams -----------------------------------
# Real gRPC servers that speak raw bytes, to drive the paths Triton will not on demand:
# metadata and deadline as seen upstream, custom status/trailers, an UNAVAILABLE
# answered by the server itself, a stream that dies after its first response.

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


class FakeUpstream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.cancelled = asyncio.Event()
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.backend = Backend(name, "127.0.0.1", 1, self.port, 1)

    def service(self, details):
        if details.method == INFER:
            return grpc.unary_unary_rpc_method_handler(self.unary)
        if details.method == STREAM:
            return grpc.stream_stream_rpc_method_handler(self.stream)
        return None

    async def unary(self, request: bytes, context) -> bytes:
        self.calls += 1
        if request == b"meta":
            keys = sorted(k for k, _ in context.invocation_metadata())
            remaining = context.time_remaining()  # None: no deadline
            return repr((keys, dict(context.invocation_metadata()).get("x-tag"),
                         None if remaining is None else round(remaining, 1))).encode()
        if request == b"fail":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full on " + self.name,
                                (("x-why", "because"),))
        if request == b"unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model reloading")
        return self.name.encode() + b":" + request

    async def stream(self, requests, context) -> None:
        self.calls += 1
        try:
            async for message in requests:
                await context.write(self.name.encode() + b":" + message)
                if message == b"die":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "gone mid-stream")
                if message == b"hang":
                    await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture
async def fakes():
    made = [FakeUpstream("0"), FakeUpstream("1")]
    for f in made:
        await f.server.start()
    yield made
    for f in made:
        await f.server.stop(None)


@pytest.mark.unit
async def test_fake_metadata_and_deadline_forwarded(fakes, proxy_factory):
    proxy, _ = await proxy_factory((fakes[0].backend,))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
        out = await ch.unary_unary(INFER)(b"meta", timeout=5.0,
                                          metadata=(("x-tag", "abc"), ("x-bin-bin", b"\x00\x01")))
    keys, tag, remaining = eval(out.decode())
    assert tag == "abc" and "x-bin-bin" in keys
    assert not [k for k in keys if k.startswith(":") or k == "te"]
    assert 4.0 <= remaining <= 5.0  # the client's deadline, not the proxy's 300 s default


@pytest.mark.unit
async def test_fake_no_client_deadline_gets_proxy_bound(fakes, proxy_factory):
    # A hung instance must not hold a unary call forever: without a client deadline
    # the proxy applies --idle-timeout-s.
    proxy, _ = await proxy_factory((fakes[0].backend,), idle_timeout_s=42.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
        out = await ch.unary_unary(INFER)(b"meta")
    assert 41.0 <= eval(out.decode())[2] <= 43.0  # grpc-timeout rounds up


@pytest.mark.unit
async def test_fake_status_details_and_trailers_passed_through(fakes, proxy_factory):
    proxy, ready = await proxy_factory((fakes[0].backend,))
    sinks = Sinks(ready)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await ch.unary_unary(INFER)(b"fail")
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert exc.value.details() == "queue full on 0"
    assert ("x-why", "because") in tuple(exc.value.trailing_metadata())
    assert fakes[0].calls == 1  # not retried
    assert not sinks.failures  # an answer from the instance is not an instance failure


@pytest.mark.unit
async def test_fake_server_side_unavailable_retried_not_blamed(fakes, proxy_factory):
    proxy, ready = await proxy_factory(tuple(f.backend for f in fakes), lb_policy="round-robin")
    sinks = Sinks(ready)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await ch.unary_unary(INFER)(b"unavailable")
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert exc.value.details() == "model reloading"
    assert [f.calls for f in fakes] == [1, 1]  # one try on each, then the last answer
    assert not sinks.failures


@pytest.mark.unit
async def test_fake_stream_not_retried_after_first_response(fakes, proxy_factory):
    proxy, _ = await proxy_factory(tuple(f.backend for f in fakes))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
        call = ch.stream_stream(STREAM)()
        await call.write(b"hello")
        first = await call.read()
        await call.write(b"die")
        second = await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await call.read()
    assert first.endswith(b":hello") and second.endswith(b":die")
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert exc.value.details() == "gone mid-stream"
    assert sum(f.calls for f in fakes) == 1


@pytest.mark.unit
async def test_fake_stream_half_close_and_many_messages(fakes, proxy_factory):
    proxy, _ = await proxy_factory((fakes[1].backend,))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
        call = ch.stream_stream(STREAM)(iter([b"m%d" % i for i in range(100)]))
        got = [m async for m in call]
        assert await call.code() == grpc.StatusCode.OK
    assert got == [b"1:m%d" % i for i in range(100)]
    assert proxy.inflight()["1"] == 0


@pytest.mark.unit
async def test_fake_stream_client_cancel_cancels_upstream(fakes, proxy_factory):
    proxy, _ = await proxy_factory((fakes[0].backend,))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
        call = ch.stream_stream(STREAM)()
        await call.write(b"hang")
        assert await call.read() == b"0:hang"
        assert proxy.inflight()["0"] == 1
        call.cancel()
        await asyncio.wait_for(fakes[0].cancelled.wait(), 5)
    for _ in range(100):
        if proxy.inflight()["0"] == 0:
            break
        await asyncio.sleep(0.02)
    assert proxy.inflight()["0"] == 0


@pytest.mark.unit
async def test_retired_channel_closed_and_stop_is_clean(fakes, proxy_factory):
    proxy, ready = await proxy_factory(tuple(f.backend for f in fakes), lb_policy="round-robin")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
        for _ in range(4):  # round robin: both channels get made
            await ch.unary_unary(INFER)(b"x")
        assert set(proxy._upstreams) == {"0", "1"}
        ready.publish((fakes[1].backend,))
        assert set(proxy._upstreams) == {"1"} and len(proxy._retired) == 1
        for _ in range(4):
            assert (await ch.unary_unary(INFER)(b"x")).startswith(b"1:")
    await proxy.stop(0.1)
    assert not proxy._tasks and not proxy._retired
