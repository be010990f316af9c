"""Pinning each rank to the CPUs and memory node local to its GPU, and checking it took.

mpirun runs with `--bind-to none` (its own binding would put every instance's rank 0 on
core 0), so the binding is done per rank instead: a wrapper in the rank's app context,
`numactl --physcpubind=CPUS --membind=NODES --` (or `taskset -c CPUS`, CPUs only), that
sets the affinity and execs tritonserver. The affinity is inherited by everything the
rank starts (the Python-backend stubs) and survives mpirun's own launch, whatever MPI.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from orchestrator.topology import RankAffinity, Topology, format_ids, parse_ids, rank_affinity


@dataclass(frozen=True)
class Pinner:
    tool: str  # "numactl" | "taskset"
    path: str

    def argv(self, aff: RankAffinity) -> tuple[str, ...]:
        if not aff.cpus:
            return ()  # nothing local we may use: the rank floats
        if self.tool == "numactl":
            mem = (f"--membind={aff.mem_list}",) if aff.mems else ()
            return (self.path, f"--physcpubind={aff.cpu_list}", *mem, "--")
        # taskset takes the list as its first operand and stops reading options there.
        return (self.path, "-c", aff.cpu_list)

    @property
    def binds_memory(self) -> bool:
        return self.tool == "numactl"


def process_allowed(pid: int | str = "self", proc_root: str = "/proc") -> tuple[frozenset[int], frozenset[int]]:
    """(CPUs, memory nodes) a process may use, from /proc/PID/status (its cpuset and mask)."""
    fields = _status_fields(Path(proc_root) / str(pid) / "status")
    return (frozenset(parse_ids(fields.get("Cpus_allowed_list", ""))),
            frozenset(parse_ids(fields.get("Mems_allowed_list", ""))))


def _status_fields(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = value.strip()
    return out


Run = Callable[..., Any]


def plan_affinity(topology: Topology | None, gpus: tuple[int, ...], mode: str, host_checks: bool = True,
                  which: Callable[[str], str | None] = shutil.which,
                  run: Run = subprocess.run) -> tuple[dict[int, RankAffinity], Pinner | None, list[str]]:
    """Where each GPU's rank should run, the wrapper that puts it there, and notes for `plan`.

    `host_checks` off (a topology recorded on another machine, shown by `plan`): the
    recorded CPUs as they are and numactl untried, since this host is not where they apply.
    """
    if topology is None or mode == "off":
        return {}, None, []
    if host_checks:
        cpus, mems = process_allowed()
    else:
        cpus = frozenset(c for g in topology.gpus for c in g.cpus)
        mems = frozenset(m for g in topology.gpus for m in g.numa_nodes)
    wanted = {}
    notes = []
    for gpu in gpus:
        aff = rank_affinity(topology.gpu(gpu), cpus, mems)
        if aff is None:
            notes.append(f"GPU {gpu}: no local CPUs known" + (" that this process may use" if host_checks else "")
                         + "; its rank floats over all CPUs")
        else:
            wanted[gpu] = aff
    if not host_checks:
        return wanted, Pinner("numactl", which("numactl") or "numactl"), notes
    pinner, note = choose_pinner(wanted.values(), which, run)
    return (wanted if pinner else {}), pinner, notes + ([note] if note else [])


def choose_pinner(affinities: Iterable[RankAffinity], which: Callable[[str], str | None] = shutil.which,
                  run: Run = subprocess.run) -> tuple[Pinner | None, str]:
    """numactl if it can apply every planned affinity here, else taskset, else none.

    Each distinct wrapper is tried once on `true`: numactl refuses outright on hosts (and
    sandboxes) without NUMA policy support, and a wrapper that fails would make every rank
    exit at launch and the instance restart forever. Returns the pinner and, when it is
    weaker than asked, a note saying why.
    """
    wanted = sorted({(a.cpus, a.mems): a for a in affinities if a.cpus}.values(), key=lambda a: (a.cpus, a.mems))
    if not wanted:
        return None, ""
    true = which("true") or "/bin/true"
    why = []
    for tool in ("numactl", "taskset"):
        path = which(tool)
        if not path:
            why.append(f"{tool} not found")
            continue
        pinner = Pinner(tool, path)
        failed = _first_failure(pinner, wanted, true, run)
        if failed is None:
            note = "" if pinner.binds_memory or not any(a.mems for a in wanted) else \
                "memory not bound to the GPU's NUMA node (" + "; ".join(why) + "): CPUs only, with taskset"
            return pinner, note
        why.append(failed)
    return None, "CPU affinity not applied: " + "; ".join(why)


def _first_failure(pinner: Pinner, wanted: list[RankAffinity], true: str, run: Run) -> str | None:
    for aff in wanted:
        argv = [*pinner.argv(aff), true]
        try:
            out = run(argv, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{pinner.tool} failed: {exc}"
        if out.returncode != 0:
            said = (out.stderr or out.stdout).strip().splitlines()
            return f"`{' '.join(argv)}` failed: {said[0] if said else 'exit ' + str(out.returncode)}"
    return None


# --- checking a running instance (scripts/gpu-acceptance) ----------------------------------
@dataclass(frozen=True)
class RankCheck:
    instance: str
    rank: int
    pid: int
    expected_cpus: str
    actual_cpus: str
    expected_mems: str  # "" when memory is not bound: any node passes
    actual_mems: str

    @property
    def ok(self) -> bool:
        return self.expected_cpus == self.actual_cpus and \
            (not self.expected_mems or self.expected_mems == self.actual_mems)


# Their command lines carry the ranks' `--id=` too (mpirun: every rank's; a wrapper: its
# rank's until it execs), but they are not ranks and are not pinned.
NOT_RANKS = frozenset({"mpirun", "mpiexec", "orterun", "prterun", "setpriv", "numactl", "taskset"})


def rank_of(pid: int, proc_root: str = "/proc") -> tuple[str, int] | None:
    """(instance id, rank) from a tritonserver rank's `--id=instanceI-rankR`, else None."""
    try:
        argv = (Path(proc_root) / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if Path(argv[0].decode(errors="replace")).name in NOT_RANKS:
        return None
    for arg in argv:
        text = arg.decode(errors="replace")
        if text.startswith("--id=instance") and "-rank" in text:
            inst, _, rank = text[len("--id=instance"):].rpartition("-rank")
            if rank.isdigit():
                return inst, int(rank)
    return None


def check_rank_affinity(plan: dict[str, Any], pids: Iterable[int], proc_root: str = "/proc") -> list[RankCheck]:
    """Each rank among `pids` against `trtllm-orch plan --json`'s per-rank affinity.

    Reads what the kernel enforces (/proc/PID/status Cpus_allowed_list, Mems_allowed_list),
    so it catches a wrapper that did not run as well as a wrong plan. Ranks the plan does
    not pin are expected to have every CPU this process may use.
    """
    planned = {(inst["instance_id"], entry["rank"]): entry
               for inst in plan["instances"] for entry in inst.get("affinity", [])}
    floating_cpus, _ = process_allowed(proc_root=proc_root)
    out = []
    for pid in sorted(set(pids)):
        who = rank_of(pid, proc_root)
        if who is None:
            continue  # mpirun, a backend stub, or a wrapper not yet exec'ed
        try:
            cpus, mems = process_allowed(pid, proc_root)
        except OSError:
            continue  # gone since the status was read
        entry = planned.get(who, {"cpus": format_ids(floating_cpus), "mems": ""})
        out.append(RankCheck(who[0], who[1], pid, format_ids(parse_ids(entry["cpus"])), format_ids(cpus),
                             format_ids(parse_ids(entry["mems"])), format_ids(mems)))
    return out
