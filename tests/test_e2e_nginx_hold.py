"""NGINX mode holds a request while no instance can take it, as the embedded proxy does: its side
workers are the HTTP upstream's `backup` server (controlplane/side_workers.py), which NGINX uses
only when every instance refused, failed or is skipped. Real nginx, real tritonserver ranks
under mpirun, the TRT-LLM twin.

Before, NGINX answered such a request 502 or 503 at once (docs/health.md; the chaos soak's
"none serving": 72-436 answers per 90 s run).
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.test_e2e_proxy import generate, rank0

pytestmark = pytest.mark.e2e


def test_requests_while_every_instance_restarts_are_held_and_answered(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, proxy="nginx", extra=("--hold-s", "60")).start()
    assert generate(run)[0] == 200
    for iid in ("0", "1"):  # every instance's rank 0 at once: none can answer until one is relaunched
        rank0(run, iid).send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: (generate(run, f"held {i}", 2), time.monotonic() - t0), range(6)))
    bad = [r for r, _ in results if r[0] != 200]
    assert not bad, bad[:3]
    assert all(json.loads(data)["text_output"] for (_, data), _ in results)
    st = run.status()
    side = next(p for p in st["proxies"] if p["kind"] == "nginx")["side"]
    assert side["requests"] >= 1, side  # NGINX's backup took them (no instance could)
    assert sum(i["restarts"] for i in st["instances"]) >= 2
    waited = sorted(round(s, 2) for _, s in results)
    print(f"6 requests during both instances' restart: all 200, answered after {waited} s; "
          f"{side['requests']} through the side workers")
