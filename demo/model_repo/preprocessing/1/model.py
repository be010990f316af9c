"""The twin's `preprocessing`: text -> token ids, with TRT-LLM's tensor names.

Tokenization is twin.tokens (UTF-8 bytes, the same ids the shipped tokenizer.json
gives), so the model needs no `transformers`. Stop/bad words: each entry of
STOP_WORDS_DICT/BAD_WORDS_DICT is a comma-separated list; a word the toy model
generates becomes its one word token (so it can match), any other text its bytes.
"""
import csv
import os
import sys

# pb_utils first: setup-triton's copy of it applies $PYTHONPATH (which the
# stub's isolated interpreter ignores), so numpy<2 is found before any other.
import triton_python_backend_utils as pb_utils  # isort: skip
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from twin import tokens  # noqa: E402


def _texts(arr):
    out = []
    for v in arr.reshape(-1):
        out.append(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v))
    return out


def _word_ids(word):
    wid = tokens.word_id(word.strip())
    return [wid] if wid is not None else list(word.encode("utf-8"))


def _word_list(arr, batch):
    """[batch, n] strings -> [batch, 2, L]: flat ids, then end offsets (padding 0 / -1)."""
    rows = []
    for b in range(batch):
        items = [] if arr is None else _texts(arr.reshape(arr.shape[0], -1)[min(b, arr.shape[0] - 1)])
        flat, offsets = [], []
        for item in items:
            for fields in csv.reader([item]):
                for word in fields:
                    if word:
                        flat += _word_ids(word)
                        offsets.append(len(flat))
        rows.append((flat, offsets))
    width = max([1] + [len(f) for f, _ in rows])
    out = np.zeros((batch, 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for b, (flat, offsets) in enumerate(rows):
        out[b, 0, :len(flat)] = flat
        out[b, 1, :len(offsets)] = offsets
    return out


def _per_row(arr, batch, default):
    if arr is None:
        return np.full((batch, 1), default, dtype=np.int32)
    return arr.reshape(arr.shape[0], -1)[:, :1].astype(np.int32)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            get = lambda name: (lambda t: None if t is None else t.as_numpy())(  # noqa: E731
                pb_utils.get_input_tensor_by_name(request, name))
            query = get("QUERY")
            batch = query.shape[0]
            ids = [tokens.encode(t) for t in _texts(query.reshape(batch, -1)[:, 0])]
            width = max(len(r) for r in ids)
            end_id = _per_row(get("END_ID"), batch, tokens.END_ID)
            pad_id = _per_row(get("PAD_ID"), batch, tokens.PAD_ID)
            input_id = np.tile(pad_id, (1, width)).astype(np.int32)
            for i, r in enumerate(ids):
                input_id[i, :len(r)] = r
            out = [
                pb_utils.Tensor("INPUT_ID", input_id),
                pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(r)] for r in ids], dtype=np.int32)),
                # Decoder-only model: a single pad token, as for TRT-LLM's GPT-style models.
                pb_utils.Tensor("DECODER_INPUT_ID", pad_id.copy()),
                pb_utils.Tensor("REQUEST_DECODER_INPUT_LEN", np.ones((batch, 1), dtype=np.int32)),
                pb_utils.Tensor("BAD_WORDS_IDS", _word_list(get("BAD_WORDS_DICT"), batch)),
                pb_utils.Tensor("STOP_WORDS_IDS", _word_list(get("STOP_WORDS_DICT"), batch)),
                pb_utils.Tensor("EMBEDDING_BIAS", np.zeros((batch, 0), dtype=np.float32)),
                pb_utils.Tensor("REQUEST_OUTPUT_LEN", get("REQUEST_OUTPUT_LEN").astype(np.int32).reshape(batch, -1)),
                pb_utils.Tensor("OUT_END_ID", end_id),
                pb_utils.Tensor("OUT_PAD_ID", pad_id),
            ]
            extra = get("PROMPT_TABLE_EXTRA_ID")
            if extra is not None:
                out.append(pb_utils.Tensor("OUT_PROMPT_TABLE_EXTRA_IDS",
                                           np.tile(extra.reshape(batch, 1).astype(np.uint64), (1, width))))
            responses.append(pb_utils.InferenceResponse(output_tensors=out))
        return responses
