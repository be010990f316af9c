"""The TensorRT-LLM twin: a pure-Python model of a leader-mode TRT-LLM engine.

Importable without Triton (unit tests use it directly); the Triton models in
demo/model_repo reach it through a `twin` link in their version directories.
"""
