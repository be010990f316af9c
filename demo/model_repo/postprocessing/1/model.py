"""The twin's `postprocessing`: token ids -> text, as TRT-LLM's does with its tokenizer.

Each response is decoded on its own (a streamed chunk is the text of its new tokens):
byte ids are gathered into UTF-8, word ids become " word", and special tokens are
dropped when `skip_special_tokens` (default true).
"""
import json
import os
import sys

# pb_utils first: setup-triton's copy of it applies $PYTHONPATH (which the
# stub's isolated interpreter ignores), so numpy<2 is found before any other.
import triton_python_backend_utils as pb_utils  # isort: skip
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from twin import tokens  # noqa: E402
from twin.params import get, raw_params  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = raw_params(json.loads(args["model_config"]))
        self.skip_special = get(params, "skip_special_tokens", True, bool)

    def execute(self, requests):
        responses = []
        for request in requests:
            toks = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            toks = toks.reshape(toks.shape[0], -1, toks.shape[-1])
            lengths = lengths.reshape(toks.shape[0], -1)
            texts = []
            for b in range(toks.shape[0]):
                for beam in range(toks.shape[1]):
                    n = int(lengths[b][beam])
                    texts.append(tokens.decode(toks[b][beam][:n].tolist(), self.skip_special).encode("utf-8"))
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT", np.array(texts, dtype=np.object_))]))
        return responses
