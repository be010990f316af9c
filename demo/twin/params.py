"""Reading the tensorrt_llm model's config.pbtxt parameters as TRT-LLM does.

A value still written `${...}` (or empty) is unset and falls back to the default;
TRT-LLM logs a warning and does the same. `batching_strategy`/`gpt_model_type` has
no fallback: anything but V1/inflight_batching/inflight_fused_batching fails the load.
"""
import os

from .engine import EngineConfig

GPT_MODEL_TYPES = ("v1", "inflight_batching", "inflight_fused_batching")


def raw_params(model_config):
    return {k: (v or {}).get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def is_unset(value):
    return value is None or value.strip() == "" or value.strip().startswith("${")


def get(params, key, default, cast=str):
    value = params.get(key)
    if is_unset(value):
        return default
    if cast is bool:
        return value.strip().lower() in ("1", "true", "yes", "on")
    return cast(value.strip())


class TwinSettings:
    def __init__(self, model_config, environ=None):
        env = os.environ if environ is None else environ
        p = raw_params(model_config)
        gpt_type = get(p, "gpt_model_type", "")
        if gpt_type.lower() not in GPT_MODEL_TYPES:
            raise ValueError("Invalid gpt_model_type. Must be v1/inflight_batching/inflight_fused_batching.")
        self.decoupled = bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))
        policy = model_config.get("dynamic_batching", {}).get("default_queue_policy", {})
        decode_ms = get(p, "twin_decode_ms", 20.0, float)
        if env.get("DEMO_TOKEN_DELAY_MS"):     # the knob the orchestrator's tests and benches use
            decode_ms = float(env["DEMO_TOKEN_DELAY_MS"])
        self.engine = EngineConfig(
            # The engine's own max batch size is a build option in TRT-LLM; unset, the
            # twin uses Triton's max_batch_size (triton_max_batch_size).
            max_batch_size=get(p, "twin_engine_max_batch_size",
                               max(1, int(model_config.get("max_batch_size", 64) or 64)), int),
            # TRT-LLM's backend passes the queue policy's max_queue_size to the executor.
            # twin_engine_max_queue_size sets the engine's limit alone: Triton's own queue
            # policy also caps its scheduler queue (rejecting bursts with "Exceeds maximum
            # queue size") and, in tritonserver 2.51, now and then holds a request ~0.5 s.
            max_queue_size=get(p, "twin_engine_max_queue_size", int(policy.get("max_queue_size", 0) or 0), int),
            max_tokens_in_paged_kv_cache=get(p, "max_tokens_in_paged_kv_cache", 1 << 20, int),
            tokens_per_block=get(p, "twin_tokens_per_block", 64, int),
            enable_kv_cache_reuse=get(p, "enable_kv_cache_reuse", True, bool),
            batch_scheduler_policy=get(p, "batch_scheduler_policy", "guaranteed_no_evict").lower(),
            decode_ms=decode_ms,
            prefill_ms_per_token=get(p, "twin_prefill_ms_per_token", 0.05, float),
        )
        self.exclude_input_in_output = get(p, "exclude_input_in_output", False, bool)
        self.cancellation_check_period_ms = get(p, "cancellation_check_period_ms", 100, int)
        self.engine_load_time_s = get(p, "twin_engine_load_time_s", 0.0, float)
        self.max_beam_width = get(p, "max_beam_width", 1, int)
