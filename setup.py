"""The one part of trtllm-orch that is compiled: the shared prefix index's slot operations
(orchestrator/dataplane/_prefix_slots.c). Optional: where no C compiler is, the install goes on
and the index runs the same operations in Python (up to twice the time per routing decision; the
same routing but for how fresh its times are, shared_prefix.py)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("orchestrator.dataplane._prefix_slots", ["orchestrator/dataplane/_prefix_slots.c"],
                             optional=True)])
