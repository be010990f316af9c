"""The data plane's compiled front (issue 22, `--front compiled`): a worker's native generations
relayed in C (_front.c), every other request handed to the worker's aiohttp server with its
connection.

compiled.py starts it on the worker's event loop with the product's rules from their one
definitions (the routes it serves, header hygiene from headers.py, slow-client deadlines and
answers from client_guard.py), adopts the connections the acceptor takes, stops it; path.py
answers its per-request callbacks with the embedded path's rules (surface, hold, pick, retries,
passive health, metrics). bench/_compiled_front.py runs the bare relay for dataplane_bench.
"""
