"""The data plane's compiled front (issue 22): a worker's hot native routes relayed in C
(_front.c), every other request handed to the worker's aiohttp side with its connection.

`compiled.py` gives the C module the product's rules from their one definitions (the hot routes,
header hygiene from headers.py, slow-client deadlines and answers from client_guard.py) and feeds
a handed-off connection to aiohttp. Not a worker mode yet: bench/_compiled_front.py runs it.
"""
