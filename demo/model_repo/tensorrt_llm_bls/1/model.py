"""The twin's `tensorrt_llm_bls`: the ensemble's pipeline as one Python model, as
TensorRT-LLM's BLS model runs it: `preprocessing`, then `tensorrt_llm` (streamed when
the request asks for `stream` and the repository is decoupled), then `postprocessing`
for each response, through BLS calls (pb_utils.InferenceRequest(...).exec()).

Each request is served on a thread of its own, so one instance serves many requests
at once (TRT-LLM's BLS serves one at a time per instance: bls_instance_count). A
client that cancels a streamed request gets its generation stopped (`stop` with the
request id, as TRT-LLM's BLS does). Not modelled: speculative decoding through a
draft model and multimodal encoders (refused), the text-level stop-word check (the
engine's token-level one applies).
"""
import json
import os
import sys
import threading
import uuid

# pb_utils first: setup-triton's copy of it applies $PYTHONPATH (which the
# stub's isolated interpreter ignores), so numpy<2 is found before any other.
import triton_python_backend_utils as pb_utils  # isort: skip
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from twin import bls  # noqa: E402
from twin.params import get, raw_params  # noqa: E402


def _outputs(response):
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return {t.name(): t.as_numpy() for t in response.output_tensors()}


def _request(model, tensors, outputs, request_id=""):
    return pb_utils.InferenceRequest(model_name=model, inputs=[pb_utils.Tensor(k, v) for k, v in tensors.items()],
                                     requested_output_names=list(outputs), request_id=request_id)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = raw_params(config)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.accumulate = get(params, "accumulate_tokens", False, bool)
        self.llm = get(params, "tensorrt_llm_model_name", "tensorrt_llm")
        self.draft = get(params, "tensorrt_llm_draft_model_name", "")
        self.encoders = get(params, "multimodal_encoders_name", "")

    def execute(self, requests):
        for request in requests:
            inputs = {}
            for name in bls.INPUTS:
                t = pb_utils.get_input_tensor_by_name(request, name)
                if t is not None:
                    inputs[name] = np.array(t.as_numpy(), copy=True)   # outlives the request's memory
            threading.Thread(target=self._serve, args=(inputs, request.get_response_sender()),
                             name="twin-bls", daemon=True).start()
        return None

    def _serve(self, inputs, sender):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            bls.check(inputs, self.draft, self.encoders)
            batch = inputs["text_input"].shape[0]
            request_id = str(uuid.uuid4())
            pre = _outputs(_request("preprocessing", bls.preprocessing_inputs(inputs, batch),
                                    bls.FROM_PREPROCESSING).exec())
            llm_inputs = bls.tensorrt_llm_inputs(inputs, pre, batch)
            acc = bls.Accumulator() if self.accumulate and self.decoupled else None
            if not self.decoupled:
                llm = _outputs(_request(self.llm, llm_inputs, bls.LLM_OUTPUTS, request_id).exec())
                sender.send(self._respond(llm, acc), flags=final)
                return
            cancelled = False
            for response in _request(self.llm, llm_inputs, bls.LLM_OUTPUTS, request_id).exec(decoupled=True):
                llm = _outputs(response)
                if cancelled or "output_ids" not in llm:
                    continue           # the empty final response, or the rest of a cancelled stream
                if sender.is_cancelled():
                    cancelled = True
                    self._stop(request_id)
                    continue
                sender.send(self._respond(llm, acc))
            sender.send(flags=final)
        except Exception as exc:
            pb_utils.Logger.log_error(f"[twin tensorrt_llm_bls] {exc}")
            refused = isinstance(exc, bls.RequestError)
            code = pb_utils.TritonError.INVALID_ARG if refused else pb_utils.TritonError.INTERNAL
            try:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), code)), flags=final)
            except Exception:
                pass

    def _respond(self, llm, acc):
        ids, lengths = llm["output_ids"], llm["sequence_length"]
        if acc is not None:
            ids, lengths = acc.add(ids, llm.get("batch_index"))
        post = _outputs(_request("postprocessing", {"TOKENS_BATCH": ids, "SEQUENCE_LENGTH": lengths},
                                 ["OUTPUT"]).exec())
        tensors = [pb_utils.Tensor("text_output", post["OUTPUT"])]
        tensors += [pb_utils.Tensor(name, llm[name]) for name in bls.PASSED_ON if name in llm]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _stop(self, request_id):
        stop = {"input_ids": np.zeros((1, 1), np.int32), "input_lengths": np.zeros((1, 1), np.int32),
                "request_output_len": np.zeros((1, 1), np.int32), "stop": np.ones((1, 1), bool)}
        for response in _request(self.llm, stop, [], request_id).exec(decoupled=True):
            _outputs(response)
