"""The systemd unit for trtllm-orch: render it, install it.

systemd parses its own quoting in Exec*= and Environment= lines and expands `%`
specifiers everywhere (and `$VAR` in Exec lines), so a config path with a space or
a `%` would silently become a different path. Every value is escaped here, in one
place, and anything systemd cannot carry on one line is refused with the field named.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from orchestrator.errors import UsageError
from orchestrator.templates import render

TEMPLATE = "trtllm-orch.service.j2"
UNIT_NAME = "trtllm-orch.service"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+\Z")  # needs no quotes (only % and $ escaped)
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\$?\Z|[0-9]+\Z")


def _no_controls(field: str, value: str) -> None:
    if any(ord(c) < 0x20 or c == "\x7f" for c in value):
        raise UsageError(field, value, "control characters (newlines) cannot go into a systemd unit")


def _specifiers(value: str) -> str:
    return value.replace("%", "%%")


def quote_exec_arg(arg: str, field: str = "ExecStart") -> str:
    """One argument of an Exec*= line, exactly as the process will receive it."""
    _no_controls(field, arg)
    escaped = _specifiers(arg).replace("$", "$$")
    if _PLAIN.match(arg):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_line(argv: list[str], field: str) -> str:
    if not argv or not os.path.isabs(argv[0]):
        raise UsageError(field, argv[0] if argv else "", "systemd needs an absolute path to the executable")
    return " ".join(quote_exec_arg(a, field) for a in argv)


def environment_assignment(name: str, value: str) -> str:
    """`"NAME=value"` for Environment=, quoted so spaces and quotes survive."""
    if not _ENV_NAME.match(name):
        raise UsageError("environment variable", name, "not a valid name")
    _no_controls(f"environment {name}", value)
    text = _specifiers(f"{name}={value}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(config_path: Path, exe: str, state_dir: str, environment: dict[str, str], user: str | None,
                *, stop_grace_s: float = 10.0, timeout_start_s: int = 1800, watchdog_s: int = 30,
                description: str = "TensorRT-LLM/Triton instances behind one endpoint (trtllm-orch)") -> str:
    """The unit text. config_path and exe are made absolute (systemd has no cwd of ours).

    state_dir should be /run/trtllm-orch for a root service (RuntimeDirectory creates it
    0700 at start and removes it at stop); `reload` finds the daemon's socket there.
    stop_grace_s is the daemon's per-instance SIGTERM->SIGKILL grace: systemd's own
    TimeoutStopSec must outlast the daemon's drain of every instance and nginx.
    """
    config = Path(config_path).expanduser().absolute()
    if user is not None and not _USER.match(user):
        raise UsageError("--user", user, "not a valid user name")
    _no_controls("description", description)
    return render(
        TEMPLATE,
        description=_specifiers(description),
        exec_start=exec_line([exe, "up", "--config", str(config)], "ExecStart"),
        exec_reload=exec_line([exe, "reload", "--state-dir", state_dir], "ExecReload"),
        user=user,
        environment=[environment_assignment(k, v) for k, v in sorted(environment.items())],
        start_limit_interval_s=300,
        start_limit_burst=5,
        restart_sec=5,
        watchdog_s=watchdog_s,
        timeout_start_s=timeout_start_s,
        # drain + per-instance grace + nginx's grace, with room to spare.
        timeout_stop_s=int(max(90, 3 * stop_grace_s + 30)),
    )


def install_unit(text: str, unit_dir: Path, name: str = UNIT_NAME) -> Path:
    """Write the unit atomically (a half-written unit is worse than none); 0644.

    The caller runs `systemctl daemon-reload` (and enable) afterwards.
    """
    if "/" in name or not name.endswith(".service"):
        raise UsageError("unit name", name, "expected NAME.service")
    unit_dir = Path(unit_dir)
    unit_dir.mkdir(parents=True, exist_ok=True)
    target = unit_dir / name
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=unit_dir)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target
