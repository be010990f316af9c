"""Demo preprocessing: prompt text -> token ids (its UTF-8 bytes).

Shapes follow tensorrtllm_backend's preprocessing model so the ensemble wiring
looks like the real one.
"""
# pb_utils first: setup-triton's copy of it applies $PYTHONPATH (which the
# stub's isolated interpreter ignores), so numpy<2 is found before any other.
import triton_python_backend_utils as pb_utils  # isort: skip
import numpy as np  # noqa: E402


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
            out_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy()
            ids = []
            for row in query.reshape(query.shape[0], -1):
                text = row[0]
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "replace")
                ids.append(list(str(text).encode("utf-8")) or [0])
            width = max(len(r) for r in ids)
            input_id = np.zeros((len(ids), width), dtype=np.int32)
            for i, r in enumerate(ids):
                input_id[i, : len(r)] = r
            lengths = np.array([[len(r)] for r in ids], dtype=np.int32)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("INPUT_ID", input_id),
                        pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
                        pb_utils.Tensor(
                            "REQUEST_OUTPUT_LEN",
                            out_len.astype(np.int32).reshape(len(ids), -1),
                        ),
                    ]
                )
            )
        return responses
