"""Rank coupling of a leader-mode group, through every rank's tritonserver process.

In TensorRT-LLM the engine runs inside each rank's tritonserver, and every
iteration is a collective over all ranks: a stopped rank freezes the group, a dead
one takes the whole MPI job down. The Python backend stub is not an MPI rank, so:

- Rank 0's engine loop calls `PeerLink.step()` once per iteration: one line to every
  peer rank over a Unix socket in $TRTLLM_ORCH_GROUP_DIR, then it waits for every
  ack, with no timeout (an all-reduce has none either).
- A peer's stub (`PeerServer`) acks only after `on_iteration` returned, and that
  makes a synchronous round trip into its own tritonserver process (a custom-metric
  update: the stub sends an IPC message and waits for the server to apply it). So a
  SIGSTOPped server (or stub) on any rank blocks rank 0's iteration within one
  iteration; rank 0's own metric updates do the same for its own server.
- Why not BLS: the Python backend allows BLS only inside execute(), and nothing ever
  sends a request to a worker rank (its server serves no endpoint).
- Why not a C/C++ Triton backend speaking MPI inside tritonserver: it would be the
  closest copy, but it must be compiled against the server's backend API and an MPI
  whose ABI matches the mpirun that launches it (Open MPI 5 from PyPI here, Debian's 4.1
  on the GPU hosts), so every host would need a toolchain and headers, and CI a C++
  build. A synchronous custom-metric call gives the property the orchestrator depends
  on (a stopped or dead rank server stops the group within one iteration) with the
  Python backend every twin model already uses.
- Where torch + CUDA exist, `NcclLink` adds a real NCCL all-reduce per iteration on
  every rank's local GPU, so a dead or stopped peer also leaves the others blocked
  inside NCCL, as a real TP group is.
"""
import os
import socket
import threading
import time

CONNECT_LOG_EVERY_S = 10.0


def env_int(*names, default=0, environ=None):
    env = os.environ if environ is None else environ
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return int(value)
    return default


class SpansNodes(RuntimeError):
    """A group whose ranks are on several nodes: the twin cannot couple them."""


def mpi_layout(environ=None):
    """(rank, world_size, local_rank) from Open MPI or MPICH/PMI variables, else from
    Slurm's own launch (`srun --mpi=pmix`: PMIX_RANK / SLURM_PROCID, SLURM_STEP_NUM_TASKS,
    SLURM_LOCALID; PMIx itself exports no size). mpirun's variables come first: a rank
    of mpirun inside a one-task Slurm step also inherits that step's SLURM_PROCID=0.

    Raises SpansNodes for ranks that Slurm started on more than one node: the twin's
    coupling is a Unix socket (and NCCL's rendezvous a file) in $TRTLLM_ORCH_GROUP_DIR,
    which only ranks of one node share; rank 0 would wait for its peers forever.
    """
    env = os.environ if environ is None else environ
    by_mpi = any(env.get(n) not in (None, "") for n in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"))
    layout = (env_int("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", environ=env),
              env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default=1,
                      environ=env),
              env_int("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID",
                      environ=env))
    nodes = env_int("SLURM_STEP_NUM_NODES", default=1, environ=env)
    if not by_mpi and layout[1] > 1 and nodes > 1:
        raise SpansNodes(f"twin: this TP group's {layout[1]} ranks are on {nodes} nodes "
                         "(SLURM_STEP_NUM_NODES); the twin couples ranks through Unix sockets in "
                         "TRTLLM_ORCH_GROUP_DIR, on one node only: use a --tp that fits a node")
    return layout


def _read_line(sock):
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(256)
        if not chunk:
            raise ConnectionError("peer rank closed the connection")
        buf += chunk
    return buf


class PeerLink:
    """Rank 0's connections to ranks 1..N-1; one collective at a time."""

    def __init__(self, group_dir, world_size, log=print):
        self._paths = [os.path.join(group_dir, f"rank{r}.sock") for r in range(1, world_size)]
        self._socks = [None] * len(self._paths)
        self._lock = threading.Lock()
        self._log = log

    def connect_all(self):
        # Peers may start after us: retry until every one is up (no deadline, as a
        # real TP group waits for all ranks at init).
        started = last_log = time.monotonic()
        for i, path in enumerate(self._paths):
            while self._socks[i] is None:
                try:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        s.connect(path)
                    except OSError:
                        s.close()
                        raise
                    self._socks[i] = s
                except OSError as exc:
                    now = time.monotonic()
                    if now - last_log >= CONNECT_LOG_EVERY_S:
                        self._log(f"waiting {now - started:.0f}s for peer {path}: {exc}")
                        last_log = now
                    time.sleep(0.1)
        self._log(f"connected to {len(self._paths)} peer rank(s)")

    def send(self, tag):
        """First half of a collective: the iteration's message to every peer."""
        msg = (tag + "\n").encode()
        with self._lock:
            if any(s is None for s in self._socks):
                raise ConnectionError("a peer rank is gone")
            for s in self._socks:
                s.sendall(msg)

    def wait(self):
        """Second half: every peer's ack (blocks while any peer is stopped)."""
        with self._lock:
            try:
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


class PeerServer:
    """Rank N's side: for every line from rank 0, run on_iteration, then ack."""

    def __init__(self, path, on_iteration):
        self._path = path
        self._on_iteration = on_iteration
        if os.path.exists(path):
            os.unlink(path)
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(path)
        self._srv.listen(8)
        threading.Thread(target=self._accept_loop, name="twin-peer-accept", daemon=True).start()

    def _accept_loop(self):
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="twin-peer", daemon=True).start()

    def _serve(self, conn):
        with conn:
            for line in conn.makefile("rb"):
                self._on_iteration(line.decode(errors="replace").strip())
                conn.sendall(b"ack " + line)

    def close(self):
        self._srv.close()
        try:
            os.unlink(self._path)
        except OSError:
            pass


class NcclLink:
    """One tiny NCCL all-reduce per iteration across the group's GPUs (optional).

    `create` returns None where torch, CUDA or a job id for the rendezvous file is
    missing, or TWIN_NCCL=0: the twin then couples ranks through sockets only."""

    def __init__(self, dist, tensor):
        self._dist = dist
        self._tensor = tensor

    @classmethod
    def create(cls, group_dir, rank, world_size, local_rank, log=print, environ=None):
        env = os.environ if environ is None else environ
        if world_size < 2 or env.get("TWIN_NCCL", "1") == "0":
            return None
        job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or env.get("PMI_JOBID")
        if not job:
            log("NCCL link off: no MPI job id for the rendezvous file")
            return None
        try:
            import torch
            import torch.distributed as dist
        except Exception:
            return None
        if not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available():
            return None
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        store = os.path.join(group_dir, "nccl-" + "".join(c if c.isalnum() else "_" for c in job))
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world_size)
        tensor = torch.ones(1024, device=device)
        dist.all_reduce(tensor)          # first collective: the group is complete
        torch.cuda.synchronize(device)
        log(f"NCCL link up on {device}: rank {rank}/{world_size}")
        return cls(dist, tensor)

    def all_reduce(self):
        self._dist.all_reduce(self._tensor)
        self._tensor.fill_(1.0)
        # Wait for the GPU: a stopped peer must block this iteration, not a later one.
        import torch
        torch.cuda.synchronize(self._tensor.device)

    def close(self):
        try:
            self._dist.destroy_process_group()
        except Exception:
            pass
