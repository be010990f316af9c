"""systemd's notify protocol: one datagram of `KEY=value` lines to $NOTIFY_SOCKET.

Written once here so nothing else builds datagrams. Outside systemd (no
NOTIFY_SOCKET) every method is a no-op. Nothing here ever raises into the caller: a
lost notification must not take the daemon down. The first send failure is logged,
later ones only at debug (a watchdog ping every 15 s would flood the journal).

The watchdog must be pinged from the event loop itself (a timer callback, not a
thread), so that a stuck loop misses its pings and systemd restarts us.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

_log = logging.getLogger(__name__)


class SystemdNotifier:
    def __init__(self, environ: Mapping[str, str] | None = None, logger: logging.Logger | None = None) -> None:
        env = os.environ if environ is None else environ
        self._log = logger or _log
        self._failed_once = False
        self._sock: socket.socket | None = None
        raw = env.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract socket: its address starts with a NUL byte.
        self._address: str | None = ("\0" + raw[1:]) if raw.startswith("@") else (raw or None)
        self._watchdog_usec: int | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process the watchdog is meant for; a child that
        # inherited the environment must not ping on the parent's behalf.
        if usec.isdigit() and int(usec) > 0 and (not pid or (pid.isdigit() and int(pid) == os.getpid())):
            self._watchdog_usec = int(usec)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    # --- messages ----------------------------------------------------------------
    def ready(self, status: str | None = None) -> None:
        self._send("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))

    def status(self, text: str) -> None:
        self._send(f"STATUS={_one_line(text)}")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def reloading(self) -> None:
        """A reload began; READY=1 ends it. systemd >= 253 wants the time it began, too."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def extend_timeout(self, seconds: float) -> None:
        """Ask for `seconds` more before the start (or stop) timeout fires."""
        self._send(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def watchdog(self) -> None:
        if self._watchdog_usec is not None:
            self._send("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Seconds between pings (half of WATCHDOG_USEC), or None when there is no watchdog."""
        if self._watchdog_usec is None or self._address is None:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # --- transport ---------------------------------------------------------------
    def _send(self, message: str) -> None:
        if self._address is None:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # Never block the event loop on a full socket: drop the message instead.
                self._sock.setblocking(False)
            self._sock.sendto(message.encode("utf-8", "replace"), self._address)
        except Exception as exc:  # noqa: BLE001 - the contract is "never raise"
            shown = self._address.replace("\0", "@")
            if not self._failed_once:
                self._failed_once = True
                self._log.warning("systemd notify to %s failed (%s); further failures logged at debug only",
                                  shown, exc)
            else:
                self._log.debug("systemd notify to %s failed: %s", shown, exc)


def _one_line(text: str) -> str:
    # A newline would start a new KEY=value assignment in the datagram.
    return " ".join(str(text).split())
