"""A data-plane worker's file-descriptor table, grown once at start-up to what it may hold.

Why: the kernel doubles a process's descriptor table when a new descriptor does not fit, and
where threads share the table (a worker has uvloop's, the render pool's, gRPC's) it waits for
an RCU grace period before it frees the old one (fs/file.c, expand_fdtable). On the 2-core box
each doubling past 256, 512 and 1024 took 11-19 ms. A burst of new clients crosses them at
once: each client's socket and the front's connection to an instance for it. The worker's
every connection waited through them, and the burst's first requests with it: 256 streams
opened at once on a just-started worker waited 25-80 ms for their first event, the same
streams on new connections to the same worker 5-12 ms, NGINX's single-threaded workers 5-10
(bench/README, "A worker's first burst"). The table never shrinks: grown once before any
thread starts, no later descriptor pays for it, at 8 bytes and 2 bits per slot.

State: none; the table is the process's.
"""

from __future__ import annotations

import fcntl
import os
import resource

# Beside two per client connection (the client's and the front's to an instance): the listening
# and metrics sockets, the feed, shared files, the gRPC listener's, the hand-off's transient ones.
SLACK = 1024
# At most this many slots up front (512 KB of pointers): a cap of a million connections would
# otherwise cost every worker 8 MB it may never use; past it the table grows under load, a few
# doublings at most, each later than the one before.
RESERVE_MAX = 1 << 16


def wanted(max_client_connections: int, soft_limit: int = resource.RLIM_INFINITY) -> int:
    """How many descriptors a process holding `max_client_connections` clients may have open, up to
    RESERVE_MAX and its RLIMIT_NOFILE soft limit: the table `reserve_for` grows."""
    return _within(min(2 * max_client_connections + SLACK, RESERVE_MAX), soft_limit)


def _within(count: int, soft_limit: int) -> int:
    """`count`, or the RLIMIT_NOFILE soft limit where that is lower: as many as a process may open."""
    return count if soft_limit == resource.RLIM_INFINITY else min(count, soft_limit)


def reserve_for(max_client_connections: int) -> int:
    """Grow this process's table for `max_client_connections` clients (`wanted`), before the first
    burst needs it; returns the size asked (`reserve`)."""
    return reserve(wanted(max_client_connections))


def reserve(count: int) -> int:
    """Grow this process's descriptor table to hold `count` descriptors, or as many as its
    RLIMIT_NOFILE soft limit lets it open; returns the size asked of the kernel (0: nothing to
    do). No open descriptor moves or closes: a duplicate is made at the lowest free number at
    or above the top one, then closed."""
    top = _within(count, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    if top <= 3:
        return 0
    probe = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if probe < top - 1:
            os.close(fcntl.fcntl(probe, fcntl.F_DUPFD_CLOEXEC, top - 1))
    except OSError:  # EMFILE: every number from there up is open, so the table is that large
        return 0
    finally:
        os.close(probe)
    return top
