"""The twin's `tensorrt_llm` model: TensorRT-LLM's Triton interface in front of the
engine model in `twin/` (in-flight batching, queue, paged KV cache with reuse).

- Rank 0 runs the engine loop; ranks != 0 (leader mode: they load only this model)
  take part in every iteration through twin.ranks, each through its own server.
- Decoupled (`decoupled_mode:true`): one response per iteration when streaming, else
  one at the end. Not decoupled: one response per request, sent from the loop
  thread through the response sender, so requests still batch in flight.
- Every input of TRT-LLM's model is accepted; the twin honours input_ids,
  input_lengths, request_output_len, streaming, end_id, pad_id, stop/bad words,
  exclude_input_in_output, stop, the return_* flags and batch > 1 (decoupled).
  Sampling inputs (temperature, top-k/p, beam_width, penalties, seed, LoRA, ...)
  are accepted and ignored: the twin's tokens depend on the prompt only.
"""
import itertools
import json
import os
import signal
import sys
import threading
import time

# pb_utils first: setup-triton's copy of it applies $PYTHONPATH (which the
# stub's isolated interpreter ignores), so numpy<2 is found before any other.
import triton_python_backend_utils as pb_utils  # isort: skip
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
from twin.engine import Engine, EngineError, QueueFullError, Sequence  # noqa: E402
from twin.lifeline import exit_with_server  # noqa: E402
from twin.loop import EngineLoop  # noqa: E402
from twin.metrics import TrtLlmMetrics, WorkerMetrics  # noqa: E402
from twin.params import TwinSettings  # noqa: E402
from twin.ranks import NcclLink, PeerLink, PeerServer, mpi_layout  # noqa: E402

GPU_HOLD_BYTES = 64 << 20
FINAL = None  # set in initialize (pb_utils constant)
_ids = itertools.count(1)


def _log(msg):
    pb_utils.Logger.log_info("[twin tensorrt_llm] " + msg)


def _input(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _scalar(request, name, default=None, cast=int):
    arr = _input(request, name)
    if arr is None or arr.size == 0:
        return default
    return cast(arr.reshape(-1)[0])


def _words(arr, row):
    """stop_words_list/bad_words_list [batch, 2, L] -> list of token sequences."""
    if arr is None:
        return []
    a = arr.reshape(arr.shape[0] if arr.ndim == 3 else 1, 2, -1)[min(row, arr.shape[0] - 1) if arr.ndim == 3 else 0]
    ids, offsets = a[0].tolist(), [int(o) for o in a[1].tolist() if o >= 0]
    out, start = [], 0
    for end in offsets:
        if end > start:
            out.append([int(t) for t in ids[start:end]])
        start = end
    return out


def _error(msg, code=None):
    code = pb_utils.TritonError.INTERNAL if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(msg, code))


def _hold_gpu(local_rank):
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        t = torch.empty(GPU_HOLD_BYTES, dtype=torch.uint8, device=dev)
        _log(f"holding {GPU_HOLD_BYTES >> 20} MiB on {dev} ({torch.cuda.get_device_name(dev)})")
        return t
    except Exception as exc:  # torch missing or no GPU: the twin runs on CPU
        _log(f"no GPU memory held: {exc}")
        return None


class _Pending:
    """One Triton request (maybe batch > 1) in flight."""

    def __init__(self, request, sender, streaming, rows, flags):
        self.request = request
        self.sender = sender
        self.streaming = streaming
        self.rows_left = rows
        self.flags = flags          # return_* flags and exclude_input_in_output
        self.lock = threading.Lock()


class TritonPythonModel:
    def initialize(self, args):
        global FINAL
        FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        config = json.loads(args["model_config"])
        self.settings = TwinSettings(config)
        exit_with_server()
        self.model_name = args.get("model_name", "tensorrt_llm")
        self.version = str(args.get("model_version", "1"))
        self.rank, self.world_size, local_rank = mpi_layout()
        group_dir = os.environ.get("TRTLLM_ORCH_GROUP_DIR")
        self.instance = os.environ.get("TRTLLM_ORCH_INSTANCE", "-")
        self.peers = self.peer_server = self.nccl = self.loop = None
        self.inflight = {}                 # engine request id -> (pending, row, Sequence)
        self.by_client_id = {}             # Triton request id -> [engine ids] (for `stop`)
        self.lock = threading.Lock()
        self.gpu_tensor = _hold_gpu(local_rank)
        if self.settings.engine_load_time_s > 0:
            _log(f"loading engine: {self.settings.engine_load_time_s:g}s")
            time.sleep(self.settings.engine_load_time_s)

        coupled = self.world_size > 1 and group_dir
        if coupled:
            self.nccl = NcclLink.create(group_dir, self.rank, self.world_size, local_rank, log=_log)
        if self.rank != 0:
            if coupled:
                worker = WorkerMetrics(pb_utils, self.model_name, self.version)
                nccl = self.nccl

                def on_iteration(_tag):
                    worker.tick()              # round trip into this rank's own server
                    if nccl is not None:
                        nccl.all_reduce()
                self.peer_server = PeerServer(os.path.join(group_dir, f"rank{self.rank}.sock"), on_iteration)
            _log(f"worker rank {self.rank}/{self.world_size} instance={self.instance}")
            return

        self.metrics = TrtLlmMetrics(pb_utils, self.model_name, self.version, log=_log)
        if coupled:
            self.peers = PeerLink(group_dir, self.world_size, log=_log)
            self.peers.connect_all()
        self.engine = Engine(self.settings.engine)
        self.loop = EngineLoop(self.engine, collective=self._collective, on_stats=self.metrics.update,
                               on_error=self._loop_failed)
        self.loop.start()
        self._stop_poll = threading.Event()
        threading.Thread(target=self._poll_cancelled, name="twin-cancel-poll", daemon=True).start()
        c = self.settings.engine
        if int(np.__version__.split(".")[0]) >= 2:
            _log(f"WARNING numpy {np.__version__}: BYTES tensors mis-decode under NumPy 2 in this "
                 "Python backend; put numpy<2 first on PYTHONPATH (see scripts/setup-triton)")
        _log(f"rank 0/{self.world_size} instance={self.instance} decoupled={self.settings.decoupled} "
             f"slots={c.max_batch_size} queue={c.max_queue_size or 'unlimited'} "
             f"kv={c.max_tokens_in_paged_kv_cache} tokens/{c.tokens_per_block} reuse={c.enable_kv_cache_reuse} "
             f"decode_ms={c.decode_ms:g} prefill_ms_per_token={c.prefill_ms_per_token:g} "
             f"peers={'yes' if self.peers else 'no'} nccl={'yes' if self.nccl else 'no'}")

    # --- rank coupling ------------------------------------------------------------------
    def _collective(self, _iteration):
        if self.peers is not None:
            self.peers.send(f"iter {self.engine.iteration}")
        if self.nccl is not None:
            self.nccl.all_reduce()
        if self.peers is not None:
            self.peers.wait()

    def _loop_failed(self, exc):
        # A lost peer rank. TRT-LLM's ranks talk through MPI, whose errors are fatal: the
        # leader aborts and Open MPI ends the job, and what is in flight gets no answer, only
        # its connection dropped (a balancer retries it elsewhere). So the twin answers
        # nothing either and takes its server down at once; its lifeline takes this stub.
        # (It used to answer UNAVAILABLE first. Through the ensemble that is a 400, which a
        # balancer cannot tell from a client's error while the instance is still in rotation.
        # Since the lifeline kills a dead rank's stub within a millisecond, that error beat the
        # daemon's exit watcher to the proxy in 1 run of the CPU acceptance check.)
        _log(f"engine iteration failed: {exc!r}; aborting the group")
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)

    # --- requests -----------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._accept(request, sender)
            except EngineError as exc:
                msg = str(exc)
                if isinstance(exc, QueueFullError):
                    # TRT-LLM's exception text: prefix and origin around the executor's message.
                    msg = f"[TensorRT-LLM][ERROR] Assertion failed: {msg} (twin/engine.py)"
                sender.send(_error(msg), flags=FINAL)
            except Exception as exc:
                sender.send(_error(str(exc)), flags=FINAL)
        return None

    def _accept(self, request, sender):
        if self.loop is None:
            raise EngineError("this rank does not serve requests (leader mode: rank 0 does)")
        s = self.settings
        client_id = request.request_id() or ""
        if _scalar(request, "stop", False, bool):
            if not client_id:
                raise EngineError("Trying to stop a request but request ID is not provided")
            with self.lock:
                ids = self.by_client_id.get(client_id, [])
            for eid in ids:
                self.loop.cancel(eid)
            sender.send(flags=FINAL)
            return
        ids = _input(request, "input_ids")
        if ids is None:
            raise EngineError("input_ids or encoder_input_features is not present in the request.")
        ids = ids.reshape(ids.shape[0] if ids.ndim > 1 else 1, -1)
        batch = ids.shape[0]
        streaming = _scalar(request, "streaming", False, bool)
        if streaming and not s.decoupled:
            raise EngineError("Streaming is only supported if model is deployed using decoupled mode.")
        if batch > 1 and not s.decoupled:
            raise EngineError("Batch size > 1 requires the tensorrt_llm backend to be using decoupled "
                              "transaction policy")
        lengths = _input(request, "input_lengths").reshape(-1)
        out_len = _input(request, "request_output_len").reshape(-1)
        end_id = _scalar(request, "end_id")
        flags = {
            "exclude": _scalar(request, "exclude_input_in_output", s.exclude_input_in_output, bool),
            "log_probs": _scalar(request, "return_log_probs", False, bool),
            "perf": _scalar(request, "return_perf_metrics", False, bool),
            "n_in": _scalar(request, "return_num_input_tokens", False, bool),
            "n_out": _scalar(request, "return_num_output_tokens", False, bool),
            "batch": batch > 1,
        }
        stop_words, bad_words = _input(request, "stop_words_list"), _input(request, "bad_words_list")
        pending = _Pending(request, sender, streaming, batch, flags)
        seqs = []
        for row in range(batch):
            n = int(out_len[min(row, out_len.size - 1)])
            prompt = ids[row][: int(lengths[min(row, lengths.size - 1)])].tolist()
            if n <= 0:   # nothing to generate: answer at once
                pending.rows_left -= 1
                self._send(pending, row, prompt, [], None, final=pending.rows_left == 0, finished=True)
                continue
            seq = Sequence(next(_ids), prompt, n, end_id=end_id, stop_words=_words(stop_words, row),
                           bad_words=_words(bad_words, row))
            seq.on_event = self._on_event
            seqs.append((row, seq))
        with self.lock:
            for row, seq in seqs:
                self.inflight[seq.req_id] = (pending, row, seq)
            if client_id:
                self.by_client_id.setdefault(client_id, []).extend(seq.req_id for _, seq in seqs)
        for i, (row, seq) in enumerate(seqs):
            try:
                self.loop.submit(seq)
            except EngineError:
                with self.lock:
                    for _, later in seqs[i:]:
                        self.inflight.pop(later.req_id, None)
                    self._forget_client_id(client_id, [later.req_id for _, later in seqs[i:]])
                for _, earlier in seqs[:i]:
                    self.loop.cancel(earlier.req_id)
                raise

    def _forget_client_id(self, client_id, engine_ids):
        if client_id in self.by_client_id:
            left = [e for e in self.by_client_id[client_id] if e not in engine_ids]
            if left:
                self.by_client_id[client_id] = left
            else:
                del self.by_client_id[client_id]

    def _on_event(self, ev):
        """From the loop thread, at the end of the iteration that made ev.tokens."""
        seq = ev.seq
        now = time.time_ns()
        with self.lock:
            entry = self.inflight.get(seq.req_id)
            if entry is None:
                return
            if ev.finished:
                del self.inflight[seq.req_id]
                self._forget_client_id(entry[0].request.request_id() or "", [seq.req_id])
        pending, row, _ = entry
        if ev.tokens:
            if not getattr(seq, "first_token_ns", 0):
                seq.first_token_ns = now
            seq.last_token_ns = now
        final = False
        if ev.finished:
            with pending.lock:
                pending.rows_left -= 1
                final = pending.rows_left == 0
            self.metrics.finished(len(seq.prompt), len(seq.generated))
        if pending.streaming:
            if ev.tokens or final:
                self._send(pending, row, seq.prompt, ev.tokens if ev.tokens else [], seq,
                           final=final, finished=ev.finished, empty=not ev.tokens)
        elif ev.finished:
            self._send(pending, row, seq.prompt, seq.generated, seq, final=final, finished=True)

    def _send(self, pending, row, prompt, new_tokens, seq, final, finished, empty=False):
        f = pending.flags
        if empty:
            pending.sender.send(flags=FINAL)
            return
        # Streamed responses never carry the prompt; a single response does unless excluded.
        tokens = list(new_tokens) if (pending.streaming or f["exclude"]) else list(prompt) + list(new_tokens)
        out = [pb_utils.Tensor("output_ids", np.array([[tokens]], dtype=np.int32)),
               pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32))]
        if f["log_probs"]:
            out += [pb_utils.Tensor("cum_log_probs", np.zeros((1, 1), np.float32)),
                    pb_utils.Tensor("output_log_probs", np.zeros((1, 1, len(new_tokens)), np.float32))]
        if f["batch"]:
            out += [pb_utils.Tensor("batch_index", np.array([[row]], np.int32)),
                    pb_utils.Tensor("sequence_index", np.array([[0]], np.int32))]
        if f["n_in"]:
            out.append(pb_utils.Tensor("num_input_tokens", np.array([[len(prompt)]], np.int32)))
        if f["n_out"]:
            out.append(pb_utils.Tensor("num_output_tokens", np.array([[len(new_tokens)]], np.int32)))
        if f["perf"] and seq is not None:
            alloc_total = seq.reused_blocks + (seq.alloc.new if seq.alloc is not None else 0)
            i32 = lambda name, v: pb_utils.Tensor(name, np.array([[v]], np.int32))  # noqa: E731
            i64 = lambda name, v: pb_utils.Tensor(name, np.array([[v]], np.int64))  # noqa: E731
            out += [i32("kv_cache_alloc_new_blocks", alloc_total - seq.reused_blocks),
                    i32("kv_cache_reused_blocks", seq.reused_blocks),
                    i32("kv_cache_alloc_total_blocks", alloc_total),
                    i64("arrival_time_ns", seq.arrival_ns), i64("first_scheduled_time_ns", seq.first_scheduled_ns),
                    i64("first_token_time_ns", getattr(seq, "first_token_ns", 0)),
                    i64("last_token_time_ns", getattr(seq, "last_token_ns", 0)),
                    pb_utils.Tensor("acceptance_rate", np.zeros((1, 1), np.float32)),
                    i32("total_accepted_draft_tokens", 0), i32("total_draft_tokens", 0)]
        pending.sender.send(pb_utils.InferenceResponse(output_tensors=out), flags=FINAL if final else 0)

    def _poll_cancelled(self):
        # As the TRT-LLM backend does: poll every cancellation_check_period_ms and
        # cancel in the engine; the slot and blocks are freed at its next iteration.
        period = max(self.settings.cancellation_check_period_ms, 10) / 1000.0
        while not self._stop_poll.wait(period):
            cancelled = []
            # Under the lock: an entry leaves `inflight` (under it) before its final response
            # is sent, and is_cancelled() on a sender whose final response went out touches a
            # freed response factory (tritonserver died with SIGSEGV in
            # TRITONBACKEND_ResponseFactoryIsCancelled under concurrent load).
            with self.lock:
                for eid, (pending, _row, _seq) in self.inflight.items():
                    try:
                        if pending.sender.is_cancelled():
                            cancelled.append(eid)
                    except Exception:
                        pass
            for eid in cancelled:
                self.loop.cancel(eid)

    def finalize(self):
        if self.loop is not None:
            self._stop_poll.set()
            self.loop.stop()
        if self.peers is not None:
            self.peers.close()
        if self.peer_server is not None:
            self.peer_server.close()
        if self.nccl is not None:
            self.nccl.close()
        self.gpu_tensor = None
