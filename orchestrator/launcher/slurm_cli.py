"""Talking to Slurm through its own commands (scontrol, sinfo, squeue, scancel, srun).

Slurm has no stable Python API; its commands are the interface every site has. The
parsers here are pure (unit-tested on captured output); the runners come in two
kinds: `run_sync` for planning (before the event loop, or in a worker thread) and
`run_async` for the daemon, so no call ever blocks the loop that serves traffic.
Every call has a timeout: a slurmctld that does not answer must not hang us.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from orchestrator.commands import Result, run_command
from orchestrator.errors import EnvironmentProblem
from orchestrator.topology import parse_ids

SLURM_TIMEOUT_S = 20.0



def run_sync(argv: list[str], timeout_s: float = SLURM_TIMEOUT_S) -> Result:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise EnvironmentProblem(f"{argv[0]} not found: the Slurm client commands must be on PATH") from None
    except subprocess.TimeoutExpired:
        return Result(124, "", f"{argv[0]} did not answer within {timeout_s:g}s")
    return Result(out.returncode, out.stdout, out.stderr)


async def run_async(argv: list[str], timeout_s: float = SLURM_TIMEOUT_S) -> Result:
    return await run_command(argv, timeout_s)


# --- parsers (pure) -----------------------------------------------------------------------
def expand_hostlist(text: str) -> tuple[str, ...]:
    """Slurm's compressed host lists: 'node[1-3,7],gpu-a[01-02]' -> node1 node2 node3 node7 gpu-a01 gpu-a02.

    The same as `scontrol show hostnames`, without a process per call. Zero padding is
    kept ('[01-02]'); one bracket per name, which is what Slurm prints.
    """
    out: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,\[]*", text.strip()):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not m:
            out.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for n in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{n:0{width}d}{suffix}")
    return tuple(out)


def parse_fields(line: str) -> dict[str, str]:
    """`scontrol -o show ...` output: Key=Value pairs separated by spaces.

    A value may contain spaces (Reason=Not responding [root@...]): text up to the next
    ` Key=` belongs to the value before it.
    """
    fields: dict[str, str] = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z][\w/:.]*)=(.*?)(?=\s+[A-Za-z][\w/:.]*=|\s*$)", line):
        fields.setdefault(m.group(1), m.group(2).strip())
    return fields


@dataclass(frozen=True)
class NodeAllocation:
    """What a job holds on one node: CPU ids and GPU indices (GRES IDX)."""

    name: str
    cpus: tuple[int, ...]
    gpus: tuple[int, ...]
    gpu_count: int  # GRES without device files have a count but no IDX


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str  # RUNNING, COMPLETING, CANCELLED, TIMEOUT...
    nodes: tuple[str, ...]
    per_node: dict[str, NodeAllocation]


_DETAIL = re.compile(r"\bNodes=(\S+) CPU_IDs=(\S*) Mem=\S* GRES=(\S*)")


def parse_job(text: str) -> JobInfo | None:
    """`scontrol -o show job -d ID` -> JobInfo (None when Slurm knows no such job)."""
    line = next((ln for ln in text.splitlines() if ln.startswith("JobId=")), "")
    if not line:
        return None
    fields = parse_fields(line)
    nodes = expand_hostlist(fields.get("NodeList", "")) if fields.get("NodeList", "(null)") != "(null)" else ()
    per_node: dict[str, NodeAllocation] = {}
    for hosts, cpu_ids, gres in _DETAIL.findall(line):
        gpus, count = parse_gpu_gres(gres)
        for host in expand_hostlist(hosts):
            per_node[host] = NodeAllocation(host, parse_ids(cpu_ids), gpus, count)
    return JobInfo(fields.get("JobId", ""), fields.get("JobState", ""), nodes, per_node)


def parse_gpu_gres(gres: str) -> tuple[tuple[int, ...], int]:
    """'gpu:2(IDX:0-1)' / 'gpu:h100:4(IDX:0-3)' / 'gpu:2' / '' -> (indices, count)."""
    ids: list[int] = []
    count = 0
    # Items are comma-separated, but IDX lists contain commas too: split on ',' before a name.
    for item in re.split(r",(?=[A-Za-z])", gres):
        if not item.startswith("gpu"):
            continue
        m = re.fullmatch(r"gpu(?::[^:(]+)?:(\d+)(?:\(IDX:([^)]*)\))?", item)
        if not m:
            continue
        count += int(m.group(1))
        if m.group(2) and m.group(2) != "N/A":
            ids.extend(parse_ids(m.group(2)))
    return tuple(sorted(set(ids))), count


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # sinfo's StateComplete: "mixed", "down+not_responding", "idle+drain"
    reason: str  # "" when Slurm gives none

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(self.state.lower().split("+"))

    def trouble(self) -> str | None:
        """Why the node cannot run our groups now, in Slurm's words; None when it can.

        Not responding (slurmd or the machine gone), down, failed or powered off. A
        drained node is not trouble: drain stops new jobs, ours keeps running there.
        """
        bad = self.flags & {"down", "fail", "failing", "not_responding", "powered_down",
                            "powering_down", "power_down"}
        if not bad:
            return None
        why = f" ({self.reason})" if self.reason else ""
        return f"Slurm: {self.name} is {self.state.upper()}{why}"


def parse_sinfo_nodes(text: str) -> dict[str, NodeState]:
    """`sinfo -h -N -O NodeList:|,StateComplete:|,Reason:|` -> node -> NodeState."""
    out: dict[str, NodeState] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < 3 or not parts[0]:
            continue
        reason = "" if parts[2] in ("none", "(null)") else parts[2]
        out.setdefault(parts[0], NodeState(parts[0], parts[1], reason))  # once per partition
    return out


@dataclass(frozen=True)
class Step:
    step_id: str  # "JOB.STEP"
    name: str
    nodes: str


def parse_steps(text: str) -> list[Step]:
    """`squeue -h -s -o %i|%j|%N` -> steps."""
    steps = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and "." in parts[0]:
            steps.append(Step(*parts))
    return steps


# --- the commands ------------------------------------------------------------------------
def sinfo_argv(nodes: tuple[str, ...]) -> list[str]:
    return ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-O", "NodeList:|,StateComplete:|,Reason:|"]


def job_argv(job_id: str) -> list[str]:
    return ["scontrol", "-o", "show", "job", "-d", job_id]


def nodes_argv(nodes: tuple[str, ...]) -> list[str]:
    return ["scontrol", "-o", "show", "node", ",".join(nodes)]


def steps_argv(job_id: str | None = None) -> list[str]:
    # --me without a job: after a SIGKILLed daemon, `down` finds steps by name in any job.
    return ["squeue", "-h", "-s", *(["-j", job_id] if job_id else ["--me"]), "-o", "%i|%j|%N"]


def scancel_argv(step_ids: list[str], signal: str) -> list[str]:
    return ["scancel", f"--signal={signal}", *step_ids]


def sstat_argv(step_id: str) -> list[str]:
    # Asks the step's slurmstepd, through its node's slurmd, not slurmctld's records.
    return ["sstat", "-n", "-P", "-j", step_id, "-o", "JobID"]


def parse_sstat(res: Result, step_id: str) -> bool | None:
    """Whether anything of the step runs, by sstat: True (its slurmstepd answered), False
    (the node's slurmd answered cleanly and knows no such step: nothing of it runs there),
    None (no clean answer: the node is unreachable, or Slurm failed; nothing is known)."""
    if res.code != 0 or res.err.strip():
        return None
    return any(line.split("|")[0].strip() == step_id for line in res.out.splitlines())
