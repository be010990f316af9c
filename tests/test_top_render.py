"""`top` and `up`'s load progress as renderers: status dicts and fake instances in, text out."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import pytest
from rich.console import Console

from orchestrator.progress import LoadProgress, last_meaningful, meaningful, plain_line, rows
from orchestrator.top import instance_row, render

pytestmark = pytest.mark.unit

STATUS = {
    "daemon": {"pid": 42, "uptime_s": 125.0, "listen": "0.0.0.0:8080", "grpc_listen": "0.0.0.0:8081",
               "proxy": "embedded", "lb_policy": "kv-aware", "held": 3, "tokens_per_s": 123.4},
    "ready": 1, "total": 2,
    "instances": [
        {"id": "0", "gpus": [0, 1], "state": "READY", "reason": "ready after 3.1s", "last_failure": "",
         "restarts": 0, "uptime_s": 100.0, "inflight": 3,
         "engine": {"active": 3, "max_active": 8, "waiting": 1, "kv_fraction": 0.42, "kv_reused_last_minute": 12},
         "llm": {"ttft_p50_ms": 23.4, "ttft_p99_ms": 80.1, "tokens_per_s": 60.2},
         "gpu": [{"index": 0, "memory_used_mib": 30720, "memory_total_mib": 81920, "utilization_pct": 50},
                 {"index": 1, "memory_used_mib": 30720, "memory_total_mib": 81920, "utilization_pct": 70}]},
        {"id": "1", "gpus": [2, 3], "state": "BACKOFF", "reason": "mpirun exited with code 137",
         "last_failure": "mpirun exited with code 137", "restarts": 1, "uptime_s": None, "inflight": 0,
         "engine": None, "llm": None, "gpu": []},
    ],
}


def text_of(renderable, width: int = 200) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_top_renders_header_and_one_row_per_instance():
    out = text_of(render(STATUS, footer="q: quit"))
    lines = out.splitlines()
    assert "endpoint 0.0.0.0:8080" in lines[0] and "policy kv-aware" in lines[0]
    assert "tokens/s 123.4" in lines[1] and "held 3" in lines[1] and "ready 1/2" in lines[1]
    row0 = next(ln for ln in lines if ln.startswith("0 "))
    for cell in ("READY", "0,1", "1m40s", "3/8", "42%", "23.4ms", "80.1ms", "60.2", "60.0/160G", "60%"):
        assert cell in row0, (cell, row0)
    row1 = next(ln for ln in lines if ln.startswith("1 "))
    assert "BACKOFF" in row1 and "mpirun exited with code 137" in row1
    assert "q: quit" in out


POOL = {"kind": "embedded", "state": "degraded", "workers_wanted": 2, "workers_alive": 1, "connections": 7,
        "inflight": 4, "requests": 90, "last_failure": "killed by SIGKILL",
        "workers": [{"slot": 0, "pid": 11, "alive": True, "version": "0.2.0", "restarts": 0, "connections": 7,
                     "inflight": 4, "held": 0, "requests": 80, "last_exit": ""},
                    {"slot": 1, "pid": None, "alive": False, "version": "0.2.0", "restarts": 1, "connections": 0,
                     "inflight": 0, "held": 0, "requests": 10, "last_exit": "killed by SIGKILL"}]}


def test_top_and_status_show_the_data_plane_workers_total_and_each():
    from orchestrator.cli import format_status
    status = {**STATUS, "proxies": [POOL]}
    line = next(ln for ln in text_of(render(status)).splitlines() if ln.startswith("workers"))
    assert "workers 1/2" in line and "conns 7" in line and "w0:7c/4f" in line and "w1:0c/0f" in line
    text = format_status({**status, "instances": []})
    assert "data plane degraded  1/2 workers  connections 7  in flight 4  requests 90" in text
    assert "worker 1: pid -" in text and "last exit: killed by SIGKILL" in text
    assert "no compiled front" not in text_of(render(status))


def test_top_names_the_workers_that_run_no_compiled_front():
    """--front compiled where the module is not built: aiohttp serves those workers' requests."""
    workers = [POOL["workers"][0], {**POOL["workers"][0], "slot": 1, "front_missing": True}]
    status = {**STATUS, "proxies": [{**POOL, "workers": workers}]}
    line = next(ln for ln in text_of(render(status)).splitlines() if ln.startswith("workers"))
    assert line.endswith("no compiled front: w1")


def test_status_marks_a_worker_whose_code_is_not_the_daemons():
    from orchestrator.cli import format_status
    workers = [{**POOL["workers"][0], "version": "0.2.0+aaaaaaaaaa"},
               {**POOL["workers"][0], "slot": 1, "pid": 12, "version": "0.2.0+bbbbbbbbbb"}]
    status = {**STATUS, "daemon": {**STATUS["daemon"], "version": "0.2.0+bbbbbbbbbb"},
              "proxies": [{**POOL, "workers": workers}], "instances": []}
    lines = format_status(status).splitlines()
    w0 = next(ln for ln in lines if "worker 0:" in ln)
    w1 = next(ln for ln in lines if "worker 1:" in ln)
    assert "v0.2.0+aaaaaaaaaa" in w0 and "not the daemon's code" in w0
    assert "not the daemon's code" not in w1


def test_the_release_names_the_code_a_process_loaded():
    import orchestrator
    version, _, digest = orchestrator.release().partition("+")
    assert version == orchestrator.__version__ and len(digest) == 10
    assert orchestrator._code_digest() == digest  # the files have not changed since import


def test_top_shows_a_daemon_that_stopped_answering():
    out = text_of(render(STATUS, error="daemon not answering: gone"))
    assert "daemon not answering: gone" in out


# --- load progress ------------------------------------------------------------------------

def test_meaningful_log_lines():
    assert meaningful('[1,0]<stderr>: I1122 01:16:15.157670 26458 model_lifecycle.cc:472] '
                      '"loading: tensorrt_llm:1"') == "rank 0: loading: tensorrt_llm:1"
    assert meaningful("[1,1]<stderr>: +------------------+------+") == ""
    assert meaningful("[1,1]<stderr>: | Model | Version |") == ""
    assert meaningful('[1,0]<stderr>: I1122 01:16:15.806946 26459 server.cc:604] ') == ""
    assert meaningful("[trtllm-orch] launch: mpirun ...") == ""
    assert meaningful("[trtllm-orch] mpirun exited with code 1") == "[trtllm-orch] mpirun exited with code 1"
    assert last_meaningful(["[1,0]<stdout>: Loading engine 3/8", "[1,0]<stdout>: ", "[1,0]<stdout>: +--+"]) \
        == "rank 0: Loading engine 3/8"


def test_last_line_is_the_load_still_under_way_not_a_finished_model():
    glog = '[1,0]<stderr>: I1122 04:50:44.5 11217 {}] "{}"'
    engine = '[1,0]<stderr>: I1122 04:50:44.4 11217 model.py:42] "[twin tensorrt_llm] loading engine: 15s"'
    done = glog.format("model_lifecycle.cc:839", "successfully loaded 'preprocessing'")
    assert last_meaningful([engine, done]) == "rank 0: [twin tensorrt_llm] loading engine: 15s"
    assert last_meaningful([done]) == "rank 0: successfully loaded 'preprocessing'"
    assert last_meaningful([engine, done,
                            glog.format("model_lifecycle.cc:839", "successfully loaded 'tensorrt_llm'")]) \
        == "rank 0: [twin tensorrt_llm] loading engine: 15s"


@dataclass
class _State:
    value: str


@dataclass
class _Plan:
    gpus: tuple = (0,)


@dataclass
class FakeInstance:
    id: str
    state: _State
    reason: str = ""
    started_at: float | None = None
    startup_s: float | None = None
    lines: list = field(default_factory=list)
    plan: _Plan = field(default_factory=_Plan)

    def log_tail(self, n: int = 20) -> list[str]:
        return self.lines[-n:]

    def error_lines(self, n: int = 3) -> list[str]:
        return self.lines[-n:]


def test_progress_rows_per_state():
    insts = {
        "0": FakeInstance("0", _State("STARTING"), started_at=90.0, lines=["[1,0]<stdout>: loading shard 2"]),
        "1": FakeInstance("1", _State("READY"), startup_s=12.34),
        "2": FakeInstance("2", _State("FAILED"), reason="gave up after 3 failures",
                          lines=["[1,0]<stderr>: E1122 01:00:00.1 1 model.py:1] boom"]),
    }
    got = {r[0]: r for r in rows(insts, now=100.0)}
    assert got["0"][1:4] == ("STARTING", "10.0s", "rank 0: loading shard 2")
    assert got["1"][3] == "ready in 12.3s"
    assert got["2"][3] == "gave up after 3 failures" and got["2"][4] == ["rank 0: boom"]
    assert "instance=0 loading for 10s: rank 0: loading shard 2" == plain_line(insts["0"], 100.0)
    assert not LoadProgress.settled(insts)
    insts["0"].state = _State("READY")
    assert LoadProgress.settled(insts)
    table = text_of(LoadProgress(terminal=True).render(insts))
    assert "loading engines" in table and "ready in 12.3s" in table and "log: rank 0: boom" in table


async def test_plain_progress_logs_while_loading_and_stops_when_settled(monkeypatch, caplog):
    import orchestrator.progress as progress
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.05)
    loop = asyncio.get_running_loop()
    inst = FakeInstance("0", _State("STARTING"), started_at=loop.time() - 5,
                        lines=["[1,0]<stdout>: loading weights"])
    shower = LoadProgress(terminal=False)
    caplog.set_level(logging.INFO, logger="trtllm-orch")
    task = asyncio.ensure_future(shower._run_plain({"0": inst}))
    await asyncio.sleep(0.2)
    assert any("instance=0 loading for" in r.message and "loading weights" in r.message for r in caplog.records)
    inst.state = _State("READY")
    shower.changed(inst)
    await asyncio.wait_for(task, 1.0)  # settled: the plain renderer ends


def test_top_on_a_narrow_terminal_drops_columns_not_ids():
    out = text_of(render(STATUS, width=80), width=80)
    row0 = next(ln for ln in out.splitlines() if ln.startswith("0 "))
    assert "READY" in row0 and "23.4ms" in row0 and "60.2" in row0
    assert "REASON" not in out and "…" not in out.splitlines()[3]  # no squeezed header
    assert all(len(ln) <= 80 for ln in out.splitlines())
    assert "1 backoff: mpirun exited with code 137" in out  # the reason, below the table


def test_instances_not_yet_launched_are_not_settled():
    insts = {"0": FakeInstance("0", _State("STOPPED")), "1": FakeInstance("1", _State("READY"))}
    assert not LoadProgress.settled(insts)


def test_log_lines_and_reasons_are_not_read_as_markup():
    insts = {"0": FakeInstance("0", _State("STARTING"), started_at=0.0,
                               lines=['[1,0]<stderr>: I1122 01:00:00.1 1 model.py:42] "[twin tensorrt_llm] loading"'])}
    assert "rank 0: [twin tensorrt_llm] loading" in text_of(LoadProgress(terminal=True).render(insts))
    status = {**STATUS, "instances": [{**STATUS["instances"][1], "reason": "[bold] not markup"}]}
    assert "[bold] not markup" in text_of(render(status))


def test_route_column_reads_prefix_affinity_reasons_as_hit_miss_spill():
    inst = STATUS["instances"][0]
    routes = {"prefix": 6, "prefix-miss": 1, "prefix-evicted": 1, "prefix-overloaded": 2, "no-prompt": 40}
    status = {**STATUS, "instances": [dict(inst, llm={**inst["llm"], "routes": routes})]}
    out = text_of(render(status), width=220)
    assert "ROUTE h/m/s" in out and "60/20/20" in out  # no-prompt picks had no prefix at stake
    row = instance_row(dict(inst, llm={**inst["llm"], "routes": {"no-prompt": 5, "load": 3}}))
    assert row[-4] == "-"  # the ROUTE cell: nothing with a prefix at stake
