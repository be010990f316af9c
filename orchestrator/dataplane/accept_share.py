"""How many of the shared listening socket's waiting connections this worker takes.

Every worker waits on the same listening socket, and the kernel wakes all of them for a
new connection (libuv registers it without EPOLLEXCLUSIVE). Whoever calls accept() first
gets it, and a worker takes up to accept.ACCEPT_BATCH per wakeup (a busy worker must not
leave a burst waiting for seconds). So one worker took them all: two workers, 64 streams
opened at once, measured 64 and 0 (NGINX: 32 and 32), and every request on those
connections queued behind one core. On the 16-core machine that was the embedded
proxy's time to first event at 256 streams: p99 40-67 ms against NGINX's 4-10
(bench/results/dataplane_bench-*.md).

The rule: this worker takes what brings it up to an equal share of every open connection
plus the waiting ones, among the workers that are accepting and alive (shared table:
each worker publishes its own count when it wakes, after it accepts, and when a client
leaves). Past its share it declines, and the socket stays readable for the others. A
decline is bounded in time (accept.DEFER_MAX_S): a peer under its share whose loop is busy
or stuck must not leave a client waiting; after the bound this worker takes one per look
(accept.DEFER_S).

The waiting connections are the listening socket's accept queue (TCP_INFO's tcpi_unacked
on a listening socket: one getsockopt per wakeup, not per connection).

State: this worker's cells of the shared table (its count and its accepting flag); it
reads the others' cells, never writes them.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

from orchestrator.dataplane.shared_table import MAX_WORKERS, SharedTable, alive

_TCP_INFO_LEN = 104
_UNACKED = struct.Struct("=I")  # tcpi_unacked, at offset 24 of struct tcp_info
_UNACKED_OFF = 24
# How often the set of live accepting peers is read again (64 slots, a few reads each).
PEERS_EVERY_S = 0.25


def queued(sock: socket.socket) -> int:
    """Connections waiting in `sock`'s accept queue (Linux); 1 when the kernel does not say
    (the caller was woken because something is there)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError):
        return 1
    return _UNACKED.unpack_from(info, _UNACKED_OFF)[0] if len(info) >= _UNACKED_OFF + 4 else 1


class AcceptShare:
    """One worker's share of a listening socket that `table`'s workers all accept from."""

    def __init__(self, table: SharedTable, slot: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._table = table
        self._slot = slot
        self._clock = clock
        self._peers: tuple[int, ...] = ()
        self._peers_at = float("-inf")

    def accepting(self, on: bool) -> None:
        """Whether this worker takes connections now (off while paused, stopped or draining:
        then the others must not leave its share waiting for it)."""
        self._table.set_accepting(self._slot, on)

    def publish(self, mine: int) -> None:
        self._table.set_connections(self._slot, mine)

    def budget(self, mine: int, waiting: int) -> int:
        """How many of the `waiting` connections to take, holding `mine` open; publishes `mine`."""
        self.publish(mine)
        now = self._clock()
        if now - self._peers_at >= PEERS_EVERY_S:
            self._peers = tuple(w for w in range(MAX_WORKERS)
                                if w != self._slot and self._table.accepting(w) and alive(self._table, w, now))
            self._peers_at = now
        table = self._table
        # The flag again on every call: a peer that began draining since takes no share.
        peers = [w for w in self._peers if table.accepting(w)]
        if not peers:
            return waiting
        total = mine + waiting + sum(table.connections(w) for w in peers)
        share = -(-total // (len(peers) + 1))  # the ceiling: someone takes the odd one
        return max(0, min(waiting, share - mine))
