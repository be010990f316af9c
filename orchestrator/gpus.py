"""GPU inventory (NVML) and the `--gpus` spec parser."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from orchestrator.errors import EnvironmentProblem, UsageError
from orchestrator.topology import Topology


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_total_mib: int
    uuid: str = ""


def parse_gpu_spec(spec: str, available: tuple[int, ...]) -> tuple[int, ...]:
    """'all' | '0-3' | '0,2,4,6' | '0-3,6-7' -> GPU indices in the order given.

    With `--placement ordered` (and --assume-gpus) `--tp` groups GPUs in exactly this
    order, so '0,2,1,3' pairs 0 with 2; by topology the order only breaks ties.
    Every id must exist on the host; we name the ones that do.
    """
    text = spec.strip()
    if text == "all":
        if not available:
            raise UsageError("--gpus", spec, "the host has no GPUs")
        return tuple(available)
    if not text:
        raise UsageError("--gpus", spec, "empty GPU list")
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise UsageError("--gpus", spec, "empty item in GPU list")
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise UsageError("--gpus", spec, f"cannot read {part!r}; use forms like 0-3 or 0,2,4")
        start, end = int(lo), int(hi) if dash else int(lo)
        if end < start:
            raise UsageError("--gpus", spec, f"range {part!r} runs backwards")
        ids.extend(range(start, end + 1))
    seen: set[int] = set()
    dupes = sorted({i for i in ids if i in seen or seen.add(i)})  # type: ignore[func-returns-value]
    if dupes:
        raise UsageError("--gpus", spec, "duplicate GPU id(s) " + ",".join(map(str, dupes)))
    missing = [i for i in ids if i not in available]
    if missing:
        have = _describe_ids(available)
        raise UsageError("--gpus", spec, f"GPU {','.join(map(str, missing))} not on this host "
                         f"(it has {have})")
    return tuple(ids)


def _describe_ids(ids: tuple[int, ...]) -> str:
    if not ids:
        return "no GPUs"
    if list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"GPUs {ids[0]}-{ids[-1]}" if len(ids) > 1 else f"GPU {ids[0]}"
    return "GPUs " + ",".join(map(str, ids))


def nvml_inventory() -> tuple[GpuInfo, ...]:
    """The host's GPUs from NVML. Raises EnvironmentProblem when NVML is unusable."""
    try:
        import pynvml
    except ImportError:
        raise EnvironmentProblem("NVML is not available: install nvidia-ml-py, or declare GPUs "
                                 "with --assume-gpus N (CPU-only hosts and tests)") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise EnvironmentProblem(f"NVML failed to initialise ({exc}): no NVIDIA driver here? "
                                 "Use --assume-gpus N on CPU-only hosts and in tests") from None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            out.append(GpuInfo(i, name.decode() if isinstance(name, bytes) else name,
                               int(mem.total) // (1024 * 1024),
                               uuid.decode() if isinstance(uuid, bytes) else uuid))
        return tuple(out)
    finally:
        pynvml.nvmlShutdown()


def inventory(assume_gpus: int | None, recorded: Topology | None = None) -> tuple[GpuInfo, ...]:
    """The GPUs to plan with: declared (--assume-gpus), recorded (--topology FILE) or NVML's."""
    if recorded is not None:
        return tuple(GpuInfo(g.index, g.name or "recorded", 0) for g in recorded.gpus)
    if assume_gpus is not None:
        return tuple(GpuInfo(i, "assumed", 0) for i in range(assume_gpus))
    return nvml_inventory()


_nvml_lock = threading.Lock()
_nvml_ready = False


def _nvml():
    """NVML, initialised once per process and kept: nvmlInit costs tens of ms (it opens
    every device), and the daemon asks every 50 ms while a group's GPUs are released.
    Callers on the event loop run these functions in a worker thread."""
    global _nvml_ready
    import pynvml
    with _nvml_lock:
        if not _nvml_ready:
            pynvml.nvmlInit()
            _nvml_ready = True
    return pynvml


def gpu_holders(gpus: tuple[int, ...]) -> set[int]:
    """pids with a compute context on any of `gpus` (NVML indices)."""
    pynvml = _nvml()
    pids: set[int] = set()
    for index in gpus:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            pids.add(proc.pid)
    return pids


def gpu_usage(gpus: tuple[int, ...]) -> dict[int, dict]:
    """Memory and utilisation per GPU for `status`."""
    pynvml = _nvml()
    out = {}
    for index in gpus:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        out[index] = {"index": index, "memory_used_mib": int(mem.used) // (1024 * 1024),
                      "memory_total_mib": int(mem.total) // (1024 * 1024),
                      "utilization_pct": int(util.gpu)}
    return out
