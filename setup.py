"""The parts of trtllm-orch that are compiled: the shared prefix index's slot operations
(orchestrator/dataplane/_prefix_slots.c), the column sums and cell writes of the data plane's
other shared files (_shared_cells.c), and the data plane's compiled front
(orchestrator/dataplane/front/_front.c), and the default routing policy's choice where no cache
is at stake (orchestrator/routing/_least_requests.c), and the cost-model's pass over its candidates
(orchestrator/routing/_cost_pass.c). Optional: where no C compiler is, the install goes on,
the same operations run in Python (up to twice the time per routing decision; the same routing
but for how fresh the index's times are, shared_prefix.py), and the front is not there."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("orchestrator.dataplane._prefix_slots", ["orchestrator/dataplane/_prefix_slots.c"],
                             optional=True),
                   Extension("orchestrator.dataplane._log_buckets", ["orchestrator/dataplane/_log_buckets.c"],
                             optional=True),
                   Extension("orchestrator.dataplane._shared_cells", ["orchestrator/dataplane/_shared_cells.c"],
                             optional=True),
                   Extension("orchestrator.dataplane.front._front", ["orchestrator/dataplane/front/_front.c"],
                             optional=True),
                   Extension("orchestrator.routing._least_requests", ["orchestrator/routing/_least_requests.c"],
                             depends=["orchestrator/routing/_numbers.h"], optional=True),
                   Extension("orchestrator.routing._cost_pass", ["orchestrator/routing/_cost_pass.c"],
                             depends=["orchestrator/routing/_numbers.h"], optional=True)])
