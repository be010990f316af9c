"""The twin's `tensorrt_llm_bls` plan, without Triton: which tensor goes where.

The BLS model runs the ensemble's three steps itself (preprocessing, tensorrt_llm,
postprocessing); this module holds the name maps between its inputs and those
models' tensors, the checks made before any step runs, and the per-row token
accumulation of `accumulate_tokens`. model.py does the Triton calls.
"""
import numpy as np

# BLS input -> preprocessing input.
TO_PREPROCESSING = {
    "text_input": "QUERY", "decoder_text_input": "DECODER_QUERY", "image_bytes_input": "IMAGE_BYTES",
    "image_url_input": "IMAGE_URL", "video_bytes_input": "VIDEO_BYTES", "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT",
    "embedding_bias_words": "EMBEDDING_BIAS_WORDS", "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
    "end_id": "END_ID", "pad_id": "PAD_ID", "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID",
}
# preprocessing output -> tensorrt_llm input.
FROM_PREPROCESSING = {
    "INPUT_ID": "input_ids", "DECODER_INPUT_ID": "decoder_input_ids", "REQUEST_INPUT_LEN": "input_lengths",
    "BAD_WORDS_IDS": "bad_words_list", "STOP_WORDS_IDS": "stop_words_list", "EMBEDDING_BIAS": "embedding_bias",
    "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id", "OUT_PROMPT_TABLE_EXTRA_IDS": "prompt_table_extra_ids",
}
# BLS input -> tensorrt_llm input (max_tokens also becomes request_output_len).
TO_TENSORRT_LLM = {
    "max_tokens": "request_output_len", "beam_width": "beam_width", "num_return_sequences": "num_return_sequences",
    "top_k": "runtime_top_k", "top_p": "runtime_top_p", "temperature": "temperature",
    "length_penalty": "len_penalty", "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
    "return_log_probs": "return_log_probs", "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits", "return_perf_metrics": "return_perf_metrics",
    "return_num_input_tokens": "return_num_input_tokens", "return_num_output_tokens": "return_num_output_tokens",
    "exclude_input_in_output": "exclude_input_in_output", "stream": "streaming",
    "prompt_embedding_table": "prompt_embedding_table", "prompt_vocab_size": "prompt_vocab_size",
    "lora_task_id": "lora_task_id", "lora_weights": "lora_weights", "lora_config": "lora_config",
    "guided_decoding_guide_type": "guided_decoding_guide_type", "guided_decoding_guide": "guided_decoding_guide",
}
INPUTS = sorted(set(TO_PREPROCESSING) | set(TO_TENSORRT_LLM)
                | {"image_input", "num_draft_tokens", "use_draft_logits"})
MULTIMODAL = ("image_input", "image_bytes_input", "image_url_input", "video_bytes_input")
# tensorrt_llm outputs the BLS model passes on as they are (output_ids and
# sequence_length go to postprocessing, which gives text_output).
PASSED_ON = (
    "cum_log_probs", "output_log_probs", "context_logits", "generation_logits", "batch_index", "sequence_index",
    "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
    "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
    "total_accepted_draft_tokens", "total_draft_tokens", "num_input_tokens", "num_output_tokens",
)
LLM_OUTPUTS = ("output_ids", "sequence_length") + PASSED_ON


class RequestError(Exception):
    """A request the BLS model refuses before calling any model."""


def with_batch(arr, batch):
    """An input as the called model wants it: [batch, ...]. Inputs the BLS config
    reshapes to scalars per row arrive as [batch]; give them back their [1]."""
    return arr.reshape(batch, 1) if arr.ndim == 1 else arr


def check(inputs, draft_model, multimodal_encoders):
    """Refuse what NVIDIA's BLS refuses, and what the twin does not model."""
    text = inputs.get("text_input")
    if text is None or text.size == 0:
        raise RequestError("text_input is required")
    max_tokens = inputs.get("max_tokens")
    if max_tokens is None or max_tokens.size == 0 or int(max_tokens.reshape(-1)[0]) <= 0:
        raise RequestError("max_tokens must be a single value > 0")
    draft = inputs.get("num_draft_tokens")
    if draft is not None and draft.size and int(draft.reshape(-1)[0]) > 0:
        if not draft_model:
            raise RequestError("cannot perform speculative decoding without draft model")
        raise RequestError("speculative decoding (tensorrt_llm_draft_model_name) is not modelled by the twin")
    if any(inputs.get(name) is not None for name in MULTIMODAL):
        if not multimodal_encoders:
            raise RequestError("multimodal inputs need multimodal_encoders_name")
        raise RequestError("multimodal inputs are not modelled by the twin")


def preprocessing_inputs(inputs, batch):
    return {TO_PREPROCESSING[k]: with_batch(v, batch) for k, v in inputs.items() if k in TO_PREPROCESSING}


def tensorrt_llm_inputs(inputs, preprocessed, batch):
    out = {FROM_PREPROCESSING[k]: v for k, v in preprocessed.items() if k in FROM_PREPROCESSING}
    out.update({TO_TENSORRT_LLM[k]: with_batch(v, batch) for k, v in inputs.items() if k in TO_TENSORRT_LLM})
    out["request_output_len"] = out["request_output_len"].astype(np.int32)
    for flag in ("return_context_logits", "return_generation_logits"):
        out.setdefault(flag, np.zeros((batch, 1), dtype=bool))
    return out


class Accumulator:
    """accumulate_tokens: each streamed response carries the text so far, not only
    its new tokens (postprocessing decodes all of a row's tokens again)."""

    def __init__(self):
        self.rows = {}

    def add(self, output_ids, batch_index):
        if output_ids.ndim != 3 or output_ids.shape[:2] != (1, 1):
            raise RequestError("accumulate_tokens needs one row and beam per response")
        row = 0 if batch_index is None else int(batch_index.reshape(-1)[0])
        seen = self.rows.get(row)
        self.rows[row] = output_ids if seen is None else np.concatenate([seen, output_ids], axis=2)
        tokens = self.rows[row]
        return tokens, np.array([[tokens.shape[2]]], dtype=np.int32)
