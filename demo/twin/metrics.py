"""TRT-LLM's metric families through the Python backend's custom-metrics API.

Names, kinds, labels (`model`, `version` + one category label) and meanings follow
TensorRT-LLM's custom metrics reporter (see ../shared/notes/trtllm-facts.md §1).
Set once per engine iteration; only changed values are sent, because every metric
call is a synchronous round trip to the server. `twin_executor_queued_requests` is
the twin's own: TRT-LLM does not export its executor queue.
"""

REQUEST = ("nv_trt_llm_request_metrics", "TRT LLM request metrics", "request_type",
           {"active": "active", "max": "max", "scheduled": "scheduled", "context": "context", "waiting": "waiting"})
KV = ("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics", "kv_cache_block_type",
      {"max": "kv_max", "free": "kv_free", "used": "kv_used", "tokens_per": "kv_tokens_per",
       "reused": "kv_reused", "fraction": "kv_fraction"})
IFB = ("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific metrics",
       "inflight_batcher_specific_metric",
       {"total_context_tokens": "total_context_tokens", "generation_requests": "generation_requests",
        "micro_batch_id": None, "paused_requests": "paused_requests"})
GENERAL = ("nv_trt_llm_general_metrics", "General TRT LLM metrics", "general_type",
           {"timestamp": "timestamp_us", "iteration_counter": "iteration"})
MEMORY = ("nv_trt_llm_runtime_memory_metrics", "TRT LLM runtime memory metrics", "memory_type",
          {"cpu": None, "gpu": None, "pinned": None})
DISAGG = ("nv_trt_llm_disaggregated_serving_metrics", "TRT LLM disaggregated serving metrics",
          "disaggregated_serving_type", ("kv_cache_transfer_ms", "request_count"))
HIST_BUCKETS = [10, 50, 100, 500, 1000]
QUEUE = ("twin_executor_queued_requests",
         "Twin only: requests in the executor queue, not yet active (TensorRT-LLM does not export this)")


class TrtLlmMetrics:
    def __init__(self, pb_utils, model="tensorrt_llm", version="1", log=None):
        MF = pb_utils.MetricFamily
        base = {"model": model, "version": version}
        self._gauges = []     # (metric, Stats attribute)
        self._families = []
        for name, desc, label, fields in (REQUEST, KV, IFB, GENERAL, MEMORY):
            fam = MF(name=name, description=desc, kind=MF.GAUGE)
            self._families.append(fam)
            for value, attr in fields.items():
                metric = fam.Metric(labels={**base, label: value})
                if attr is None:
                    metric.set(0)       # micro_batch_id, memory: constant 0 on a CPU twin
                else:
                    self._gauges.append((metric, attr))
        name, desc, label, values = DISAGG
        fam = MF(name=name, description=desc, kind=MF.COUNTER)
        self._families.append(fam)
        for value in values:
            fam.Metric(labels={**base, label: value})   # stays 0: request stats are off by default
        self._hist = {}
        for name, kind in (("nv_llm_input_token_len", "total_input_tokens"),
                           ("nv_llm_output_token_len", "total_output_tokens")):
            try:
                fam = MF(name=name, description=f"TRT LLM response metrics ({kind})", kind=MF.HISTOGRAM)
                self._families.append(fam)
                self._hist[kind] = fam.Metric(labels={**base, "response_metric_type": kind}, buckets=HIST_BUCKETS)
            except Exception as exc:   # older Python backends have no histograms
                if log:
                    log(f"no histogram metrics: {exc}")
        fam = MF(name=QUEUE[0], description=QUEUE[1], kind=MF.GAUGE)
        self._families.append(fam)
        self._queue = fam.Metric(labels=base)
        self._last = {}

    def update(self, stats):
        """One iteration's stats. iteration_counter and timestamp change every time,
        so at least one server round trip happens per iteration."""
        for metric, attr in self._gauges:
            value = getattr(stats, attr)
            if self._last.get(attr) != value:
                metric.set(value)
                self._last[attr] = value
        if self._last.get("queued") != stats.queued:
            self._queue.set(stats.queued)
            self._last["queued"] = stats.queued

    def finished(self, input_tokens, output_tokens):
        if "total_input_tokens" in self._hist:
            self._hist["total_input_tokens"].observe(input_tokens)
            self._hist["total_output_tokens"].observe(output_tokens)


class WorkerMetrics:
    """A worker rank's iteration counter: its per-iteration round trip to its own server."""

    def __init__(self, pb_utils, model="tensorrt_llm", version="1"):
        MF = pb_utils.MetricFamily
        name, desc, label, _ = GENERAL
        self._fam = MF(name=name, description=desc, kind=MF.GAUGE)
        self._counter = self._fam.Metric(labels={"model": model, "version": version, label: "iteration_counter"})
        self._n = 0

    def tick(self):
        self._n += 1
        self._counter.set(self._n)
