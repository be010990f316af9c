"""The compiled column sums, cell reads and cell writes of the data plane's shared files
(_shared_cells.c), where the install built them.

`NATIVE` is the module, or None where it was not built (setup.py builds it where a C compiler
is) or where TRTLLM_ORCH_PURE_PYTHON=1 leaves it out. Its callers (shared_table.py's
`inflight_span`, shared_pending.py's `of` and `total_with`, shared_stamps.py's `note_counts` and
`of`) read it at each call and otherwise run the same operation in Python: the files and their
layouts are theirs, the module only adds up, reads and stores what they point it at.
tests/test_shared_cells.py runs both and holds them to the same answers and bytes.
"""

from __future__ import annotations

from orchestrator import native


NATIVE = native.load("orchestrator.dataplane._shared_cells")
