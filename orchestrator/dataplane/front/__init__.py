"""The data plane's compiled front (issue 22, `--front compiled`): a worker's native generations
relayed in C (_front.c), every other request handed to the worker's aiohttp server with its
connection.

compiled.py starts it on the worker's event loop with the product's rules from their one
definitions (the routes it serves, header hygiene from headers.py, slow-client deadlines and
answers from client_guard.py), adopts the connections the acceptor takes, stops it; path.py
answers its per-request callbacks with the embedded path's rules (surface, hold, pick, retries,
passive health, metrics). bench/_compiled_front.py runs the bare relay for dataplane_bench.
"""

# The compiled relay (setup.py builds it where a C compiler is; native.load finds it or not).
MODULE = "orchestrator.dataplane.front._front"
# Why it may be missing, and how to build it.
_WHY = ("not built here (no C compiler when setup.py ran, or TRTLLM_ORCH_PURE_PYTHON=1; `pip install .` or "
        "`python setup.py build_ext --inplace` builds it)")
# What a worker (and the daemon, once at start) says where --front auto finds it not built.
NOT_BUILT = f"--front auto: the compiled front is {_WHY}; aiohttp serves every request, about a fifth of the rate " \
            "on small answers"
# Why `up --front compiled` refuses to start without it (errors.EnvironmentProblem's line).
REQUIRED = f"--front='compiled': the compiled front is {_WHY}; --front auto serves through aiohttp without it"
