"""trtllm-orch: a self-healing, load-balanced TensorRT-LLM service on one command."""

# One place for the version: setup.cfg reads it, status reports it for the daemon, each
# data-plane worker and the code that started each engine (live restore, upgrades).
__version__ = "0.2.0"
