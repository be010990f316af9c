"""bench/common.SideNginx: the NGINX the benchmarks compare against renders the product's config
with the worker count asked for (proxy_bench's targets failed to start since NGINX mode's
worker_processes followed --proxy-workers instead of `auto`, and nothing noticed)."""

from __future__ import annotations

import re
import shutil

import pytest

from bench.common import SideNginx
from orchestrator.config import Settings

pytestmark = pytest.mark.unit

STATUS = {"instances": [{"id": str(i), "bind_address": "127.0.0.1", "ports": {"http": 9000 + i, "grpc": 9100 + i,
                                                                             "metrics": 9200 + i}}
                        for i in range(2)]}


def worker_processes(side: SideNginx) -> int:
    return int(re.search(r"^worker_processes (\d+);$", side.conf.read_text(), re.M).group(1))


@pytest.mark.parametrize("workers", [1, 3])
def test_side_nginx_runs_the_workers_asked_for(workers):
    side = SideNginx(STATUS, workers=workers)
    try:
        assert worker_processes(side) == side.workers == workers
    finally:
        shutil.rmtree(side.dir)


def test_side_nginx_defaults_to_the_products_count():
    side = SideNginx(STATUS)
    try:
        assert worker_processes(side) == side.workers == Settings().worker_count()
    finally:
        shutil.rmtree(side.dir)
