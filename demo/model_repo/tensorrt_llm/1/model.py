"""Demo `tensorrt_llm` model: a decoupled, deterministic token streamer.

- Tokens come from vocab.next_tokens (a hash of the prompt), one every
  `token_delay_ms` (config parameter, overridden by $DEMO_TOKEN_DELAY_MS).
- Rank coupling: in a leader-mode group (Open MPI OMPI_COMM_WORLD_* or MPICH
  PMI_* env, plus $TRTLLM_ORCH_GROUP_DIR) ranks != 0 serve a Unix socket
  `rank{N}.sock` in the group dir; rank 0 sends one message to every peer per
  token and blocks on the replies with no timeout, like a TP all-reduce over
  NCCL. mpi4py cannot be used: the Python backend stub is not an MPI rank.
- GPU placement: with torch + CUDA, keep a 64 MiB tensor on the local rank's
  device so NVML shows this rank on its own GPU.
"""
import json
import os
import socket
import sys
import threading
import time

# pb_utils first: setup-triton's copy of it applies $PYTHONPATH (which the
# stub's isolated interpreter ignores), so numpy<2 is found before any other.
import triton_python_backend_utils as pb_utils  # isort: skip
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from vocab import next_tokens  # noqa: E402

GPU_HOLD_BYTES = 64 << 20
CONNECT_LOG_EVERY_S = 10.0


def _env_int(*names, default=0):
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def _log(msg):
    pb_utils.Logger.log_info("[demo tensorrt_llm] " + msg)


class _PeerLink:
    """Rank 0's connections to ranks 1..N-1; one collective at a time."""

    def __init__(self, group_dir, world_size):
        self._paths = [os.path.join(group_dir, f"rank{r}.sock") for r in range(1, world_size)]
        self._socks = [None] * len(self._paths)
        self._lock = threading.Lock()

    def connect_all(self):
        # Peers may start after us: retry until every one is up (no deadline,
        # as a real TP group waits for all ranks at init).
        started = last_log = time.monotonic()
        for i, path in enumerate(self._paths):
            while self._socks[i] is None:
                try:
                    self._socks[i] = self._connect(path)
                except OSError as exc:
                    now = time.monotonic()
                    if now - last_log >= CONNECT_LOG_EVERY_S:
                        _log(f"waiting {now - started:.0f}s for peer {path}: {exc}")
                        last_log = now
                    time.sleep(0.1)
        _log(f"connected to {len(self._paths)} peer rank(s)")

    @staticmethod
    def _connect(path):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:
            s.close()
            raise
        return s

    def step(self, tag):
        """Send `tag` to every peer and wait for all replies (no timeout)."""
        msg = (tag + "\n").encode()
        with self._lock:
            for i, path in enumerate(self._paths):
                if self._socks[i] is None:
                    self._socks[i] = self._connect(path)  # peer restarted?
            try:
                for s in self._socks:
                    s.sendall(msg)
                for s in self._socks:
                    _read_line(s)
            except OSError:
                self.close()
                raise

    def close(self):
        for i, s in enumerate(self._socks):
            if s is not None:
                s.close()
                self._socks[i] = None


def _read_line(sock):
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(256)
        if not chunk:
            raise ConnectionError("peer rank closed the connection")
        buf += chunk
    return buf


class _PeerServer:
    """Rank N's side: answer every line from rank 0 with an ack."""

    def __init__(self, path):
        self._path = path
        if os.path.exists(path):
            os.unlink(path)
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(path)
        self._srv.listen(8)
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self):
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn):
        with conn:
            f = conn.makefile("rb")
            for line in f:
                conn.sendall(b"ack " + line)

    def close(self):
        self._srv.close()
        try:
            os.unlink(self._path)
        except OSError:
            pass


def _hold_gpu(local_rank):
    try:
        import torch
    except Exception:
        _log("torch not importable: no GPU memory held")
        return None
    try:
        if not torch.cuda.is_available():
            _log("CUDA not available: no GPU memory held")
            return None
        count = torch.cuda.device_count()
        if local_rank >= count:
            # More ranks than visible GPUs: a misconfigured CUDA_VISIBLE_DEVICES
            # on a real group; fine for single-GPU smoke tests.
            _log(f"local rank {local_rank} but only {count} visible GPU(s): using cuda:{local_rank % count}")
        dev = torch.device("cuda", local_rank % count)
        t = torch.empty(GPU_HOLD_BYTES, dtype=torch.uint8, device=dev)
        _log(f"holding {GPU_HOLD_BYTES >> 20} MiB on {dev} ({torch.cuda.get_device_name(dev)})")
        return t
    except Exception as exc:  # a demo must not fail to load over this
        _log(f"could not allocate on GPU {local_rank}: {exc}")
        return None


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        delay = config.get("parameters", {}).get("token_delay_ms", {}).get("string_value", "20")
        delay = os.environ.get("DEMO_TOKEN_DELAY_MS") or delay
        self.token_delay_s = float(delay) / 1000.0

        self.rank = _env_int("OMPI_COMM_WORLD_RANK", "PMI_RANK")
        self.world_size = _env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)
        local_rank = _env_int("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
        group_dir = os.environ.get("TRTLLM_ORCH_GROUP_DIR")
        self.instance = os.environ.get("TRTLLM_ORCH_INSTANCE", "-")
        self.peers = None
        self.server = None
        self.threads = []
        self.gpu_tensor = _hold_gpu(local_rank)

        if self.world_size > 1 and group_dir:
            if self.rank == 0:
                self.peers = _PeerLink(group_dir, self.world_size)
                self.peers.connect_all()
            else:
                self.server = _PeerServer(os.path.join(group_dir, f"rank{self.rank}.sock"))
        if int(np.__version__.split(".")[0]) >= 2:
            _log(f"WARNING numpy {np.__version__}: BYTES tensors mis-decode under NumPy 2 in this "
                 "Python backend; put numpy<2 first on PYTHONPATH (see scripts/setup-triton)")
        _log(
            f"numpy={np.__version__} instance={self.instance} rank={self.rank}/{self.world_size} "
            f"token_delay_ms={self.token_delay_s * 1000:g} peers={'yes' if self.world_size > 1 and group_dir else 'no'}"
        )

    def execute(self, requests):
        # Decoupled: answer from a thread per request so requests overlap, as
        # in-flight batching does.
        for request in requests:
            t = threading.Thread(target=self._generate, args=(request,), daemon=True)
            t.start()
            self.threads.append(t)
        self.threads = [t for t in self.threads if t.is_alive()]
        return None

    def _generate(self, request):
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1)
            length_t = pb_utils.get_input_tensor_by_name(request, "input_lengths")
            if length_t is not None:
                ids = ids[: int(length_t.as_numpy().reshape(-1)[0])]
            count = int(pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy().reshape(-1)[0])
            stream_t = pb_utils.get_input_tensor_by_name(request, "streaming")
            streaming = bool(stream_t.as_numpy().reshape(-1)[0]) if stream_t is not None else False
            tokens = next_tokens(ids.tolist(), max(count, 0))
            produced = []
            for step, tok in enumerate(tokens):
                if sender.is_cancelled():
                    sender.send(flags=final)
                    return
                if self.peers is not None:
                    self.peers.step(f"{request.request_id() or '-'} {step}")
                time.sleep(self.token_delay_s)
                produced.append(tok)
                if streaming:
                    last = step == len(tokens) - 1
                    sender.send(_response([tok]), flags=final if last else 0)
            if not streaming:
                sender.send(_response(produced), flags=final)
            elif not tokens:
                sender.send(flags=final)
        except Exception as exc:
            # A lost TP peer means this instance cannot serve anything: say UNAVAILABLE
            # (HTTP 503, gRPC UNAVAILABLE), which load balancers retry elsewhere.
            # Anything else is our own bug: INTERNAL.
            code = pb_utils.TritonError.UNAVAILABLE if isinstance(exc, (ConnectionError, OSError)) \
                else pb_utils.TritonError.INTERNAL
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(f"demo tensorrt_llm: {exc}", code)),
                flags=final,
            )

    def finalize(self):
        if self.peers is not None:
            self.peers.close()
        if self.server is not None:
            self.server.close()
        self.gpu_tensor = None


def _response(tokens):
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("output_ids", np.array([[tokens]], dtype=np.int32)),
            pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32)),
        ]
    )
