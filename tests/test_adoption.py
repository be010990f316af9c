"""Live restore's decisions (controlplane/adoption.py) on state.json records, without
starting anything: this test's own process stands in for a live mpirun."""

from __future__ import annotations

import os
from unittest import mock

import psutil
import pytest

from orchestrator.controlplane.adoption import find_prior, same_addresses, workers_kind_for
from orchestrator.launcher.command import LaunchCommand
from orchestrator.plan import InstancePlan, Ports

pytestmark = pytest.mark.unit

PLAN = InstancePlan("0", (0,), Ports(9000, 9001, 9002), "127.0.0.1")
LISTEN = {"listen": "127.0.0.1:8080", "grpc_listen": "", "metrics_listen": ""}


def build(plan: InstancePlan) -> LaunchCommand:
    return LaunchCommand(("mpirun", "-n", "1", "tritonserver", f"--http-port={plan.ports.http}"), {"A": "1"})


def record(**kw) -> dict:
    me = psutil.Process()
    base = {"mpirun_pid": os.getpid(), "mpirun_create_time": me.create_time(),
            "launch": build(PLAN).shell_text(), "started_by": "0.1.0"}
    return {"instances": {"0": {**base, **kw}}}


def notes(state) -> list[str]:
    prior = find_prior(state, [PLAN], build, "/nonexistent/state", LISTEN)
    assert prior.instances == {}  # none of these may be adopted
    return prior.notes


def test_nothing_recorded_adopts_nothing_silently():
    assert notes(None) == [] and notes({"instances": {}}) == []


def test_an_unreadable_record_adopts_nothing_and_says_so():
    assert notes({"instances": [1, 2]}) == ["state.json unreadable: adopting nothing (its processes are swept by tag)"]
    assert notes({"instances": {"0": {"mpirun_pid": "12"}}}) == \
        ["instance 0: not adopted: its record in state.json is incomplete"]


def test_a_recycled_pid_is_not_the_group():
    (note,) = notes(record(mpirun_create_time=psutil.Process().create_time() - 100))
    assert note == f"instance 0: not adopted: mpirun pid {os.getpid()} is gone"


def test_a_changed_launch_command_on_other_gpus_or_ports_is_not_adopted():
    (note,) = notes(record(launch="mpirun -n 1 tritonserver --http-port=1"))
    assert "its launch command differs from this config's" in note and note.endswith("on other GPUs or ports")


def test_a_changed_launch_command_in_the_same_place_goes_on_to_the_identity_checks():
    # Same GPUs and ports, another argument: adoptable (then replaced by a rolling restart)
    # if it is this run's group; this test's process is not, and that is what it is told.
    same_place = "CUDA_VISIBLE_DEVICES=0 mpirun -n 1 tritonserver --http-port=9000 --grpc-port=9001 " \
                 "--metrics-port=9002 --log-verbose=1"
    (note,) = notes(record(launch=same_place))
    assert note == f"instance 0: not adopted: pid {os.getpid()} does not carry this run's environment tag"


def test_a_group_not_in_the_plan_is_not_adopted():
    (note,) = notes({"instances": {"7": record()["instances"]["0"]}})
    assert note == "instance 7: not adopted: not in this config's plan"


def test_a_process_without_the_runs_tag_is_not_adopted():
    (note,) = notes(record())  # this test process carries no TRTLLM_ORCH_STATE_DIR tag
    assert note == f"instance 0: not adopted: pid {os.getpid()} does not carry this run's environment tag"


def test_slurm_groups_are_relaunched_not_adopted():
    prior = find_prior(record(), [PLAN], build, "/x", LISTEN, local_launcher=False)
    assert prior.instances == {} and "Slurm groups are relaunched" in prior.notes[0]


def test_workers_serving_other_addresses_are_not_adopted():
    me = psutil.Process()
    state = {"instances": {}, "dataplane": {"listen": {**LISTEN, "listen": "0.0.0.0:9999"},
                                            "workers": [{"slot": 0, "pid": me.pid, "create_time": me.create_time()}]}}
    prior = find_prior(state, [PLAN], build, "/x", LISTEN)
    assert prior.workers == [] and "data plane: not adopted: it serves" in prior.notes[0]


def test_workers_of_another_kind_are_not_adopted():
    """Embedded workers serve the public sockets: a daemon started in NGINX mode on the same state
    dir must not take them as its side workers (nor the other way round). A record without the
    kind is an embedded data plane's (the only kind before the side workers)."""
    me = psutil.Process()
    worker = [{"slot": 0, "pid": me.pid, "create_time": me.create_time()}]
    cases = (({}, "nginx"), ({"workers_kind": "embedded"}, "none"), ({"workers_kind": "side"}, "embedded"))
    for recorded, proxy in cases:
        state = {"instances": {}, "dataplane": {"listen": LISTEN, "workers": worker, **recorded}}
        prior = find_prior(state, [PLAN], build, "/x", LISTEN, proxy=proxy)
        kind = workers_kind_for(proxy)
        assert prior.workers == [] and f"this config runs {kind} ones" in prior.notes[0], prior.notes
    assert workers_kind_for("embedded") == "embedded"
    assert workers_kind_for("nginx") == workers_kind_for("none") == "side"


def test_an_address_the_daemon_before_did_not_record_counts_as_unset():
    """openai_listen is recorded since the side workers: an upgrade still adopts the data plane
    of the release before, unless this config sets it."""
    now = {**LISTEN, "openai_listen": ""}
    assert same_addresses(LISTEN, now) and same_addresses(now, now)
    assert not same_addresses(LISTEN, {**LISTEN, "openai_listen": "127.0.0.1:8085"})
    assert not same_addresses(None, now)


def test_restart_counts_carry_over_adopted_or_not_slurm_too():
    # `status` counts the service's restarts, not this daemon's: a watchdog's restart of the
    # daemon showed every count at 0 (bench/chaos_soak.py). Carried for the instances planned,
    # whether the group is adopted, relaunched (its pid gone) or under Slurm.
    adopted = find_prior(record(restarts=3), [PLAN], build, "/x", LISTEN)
    assert adopted.restarts == {"0": 3}
    gone = find_prior(record(restarts=2, mpirun_create_time=psutil.Process().create_time() - 100), [PLAN], build,
                      "/x", LISTEN)
    assert gone.instances == {} and gone.restarts == {"0": 2}
    assert find_prior(record(restarts=4), [PLAN], build, "/x", LISTEN, local_launcher=False).restarts == {"0": 4}
    other = {"instances": {"7": {"restarts": 5}}}  # not in this plan: nothing to count it for
    assert find_prior(other, [PLAN], build, "/x", LISTEN).restarts == {}
    for bad in ("3", True, None):
        assert find_prior(record(restarts=bad), [PLAN], build, "/x", LISTEN).restarts == {}


def nginx_record(**kw) -> dict:
    me = psutil.Process()
    master = {"pid": me.pid, "create_time": me.create_time(), "prefix": "/x/nginx", "http_port": 8080,
              "grpc_port": None, "openai_port": 0}
    return {"instances": {}, "dataplane": {"listen": LISTEN, "nginx": {**master, **kw}}}


@pytest.mark.parametrize("state, note", [
    ({"instances": {}, "dataplane": {"listen": {**LISTEN, "listen": "0.0.0.0:9"}, "nginx": {"pid": 1}}},
     "nginx: not adopted: it serves"),
    (nginx_record(http_port="x"), "nginx: its record is incomplete: not adopted"),
    (nginx_record(create_time=0.0), f"nginx: master pid {os.getpid()} is gone"),
    # alive and recorded, but not an nginx master started with this state dir's prefix (this test)
    (nginx_record(), f"nginx: pid {os.getpid()} is not this state dir's nginx master"),
    (nginx_record(prefix="/elsewhere/nginx"), "is not this state dir's nginx master"),
])
def test_an_nginx_master_is_adopted_only_if_it_is_this_runs_and_serves_thesame_addresses(state, note):
    # (a real master is adopted end to end: tests/test_e2e_nginx_live_restore.py)
    prior = find_prior(state, [PLAN], build, "/x", LISTEN, proxy="nginx")
    assert prior.nginx is None and os.getpid() not in prior.keep_pids()
    assert any(note in n for n in prior.notes), prior.notes


def test_a_config_of_another_mode_adopts_no_nginx_master():
    """`up` in embedded mode after an NGINX-mode daemon's kill: its master, left serving the
    public port, is swept (kept, it held the port the workers bind)."""
    me = psutil.Process()
    with mock.patch("orchestrator.controlplane.adoption._runs_with", return_value=True):
        state = nginx_record()
        assert find_prior(state, [PLAN], build, "/x", LISTEN, proxy="nginx").nginx.pid == me.pid
        for proxy in ("embedded", "none"):
            prior = find_prior(state, [PLAN], build, "/x", LISTEN, proxy=proxy)
            assert prior.nginx is None and me.pid not in prior.keep_pids(), proxy
