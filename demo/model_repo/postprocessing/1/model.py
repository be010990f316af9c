"""Demo postprocessing: token ids -> text, one word per token.

Each token decodes to " <word>", so streamed chunks concatenate to exactly the
non-streamed text.
"""
import os
import sys

# pb_utils first: setup-triton's copy of it applies $PYTHONPATH (which the
# stub's isolated interpreter ignores), so numpy<2 is found before any other.
import triton_python_backend_utils as pb_utils  # isort: skip
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tensorrt_llm", "1"))
from vocab import decode  # noqa: E402


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            texts = []
            for b in range(tokens.shape[0]):
                n = int(lengths.reshape(tokens.shape[0], -1)[b][0])
                texts.append(decode(tokens[b][0][:n].tolist()).encode("utf-8"))
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUTPUT", np.array(texts, dtype=np.object_))]
                )
            )
        return responses
