"""Is a TCP port free, and if not, who holds it."""

from __future__ import annotations

import errno
import socket

import psutil


def port_is_free(host: str, port: int) -> bool:
    # SO_REUSEADDR like the servers we start: a port in TIME_WAIT is usable by
    # them, so it must not count as taken here.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def port_holder(port: int) -> str:
    """'pid 1234 (nginx)' for the listener on `port`, or '' if we cannot tell."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, PermissionError):
        return ""
    for conn in conns:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
            except psutil.Error:
                return f"pid {conn.pid}"
    return ""


def taken_ports(host: str, ports: tuple[int, ...], ignore_pids: frozenset[int] = frozenset()) -> list[str]:
    """One description per taken port, e.g. '8000 (held by pid 12 (nginx))'.

    A port held only by `ignore_pids` (leftovers the daemon will sweep under its
    lock before it launches) does not count as taken.
    """
    out = []
    for port in ports:
        if not port_is_free(host, port):
            if ignore_pids:
                holders = listening_pids((port,))
                if holders and holders <= ignore_pids:
                    continue
            holder = port_holder(port)
            out.append(f"{port} (held by {holder})" if holder else str(port))
    return out


def listening_pids(ports: tuple[int, ...]) -> set[int] | None:
    """Pids listening on any of `ports`, or None when the kernel will not say (another user's socket)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, PermissionError):
        return None
    pids = set()
    for conn in conns:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port in ports:
            if not conn.pid:
                return None
            pids.add(conn.pid)
    return pids


def interface_address(name: str) -> str:
    """The IPv4 address of a local interface (`--bind-interface`); UsageError if it has none."""
    import socket

    from orchestrator.errors import UsageError
    addrs = psutil.net_if_addrs()
    if name not in addrs:
        raise UsageError("--bind-interface", name, "no such interface here (" + ", ".join(sorted(addrs)) + ")")
    for addr in addrs[name]:
        if addr.family == socket.AF_INET:
            return addr.address
    raise UsageError("--bind-interface", name, "has no IPv4 address")
