"""Instance states and the legal moves between them. No imports from the project.

    STOPPED --start--> STARTING --ready--> READY --probe/canary/exit--> UNHEALTHY
    UNHEALTHY --> STOPPING --> BACKOFF --> STARTING        (self-healing loop)
    STARTING --exit/deadline--> STOPPING                   (failed start)
    STOPPING --> STOPPED                                   (down, or restart on request)
    STOPPING --> FAILED                                    (too many failures: not retried)
    BACKOFF --> STOPPED                                    (a stop during backoff needs no kill)
    FAILED  --> STARTING                                   (`trtllm-orch restart ID`)

READY is the only state that receives traffic; the proxy follows it.
"""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    STOPPED = "STOPPED"
    STARTING = "STARTING"
    READY = "READY"
    UNHEALTHY = "UNHEALTHY"
    STOPPING = "STOPPING"
    BACKOFF = "BACKOFF"
    FAILED = "FAILED"


# Every legal edge. Anything else is a bug in the supervisor, not a user error.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.READY, State.STOPPING}),
    State.READY: frozenset({State.UNHEALTHY, State.STOPPING}),
    State.UNHEALTHY: frozenset({State.STOPPING, State.READY}),
    State.STOPPING: frozenset({State.BACKOFF, State.STOPPED, State.FAILED, State.STARTING}),
    State.BACKOFF: frozenset({State.STARTING, State.STOPPED, State.STOPPING}),
    State.FAILED: frozenset({State.STARTING, State.STOPPED}),
}

SERVING_STATES = frozenset({State.READY})


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: State, new: State) -> None:
    if new not in TRANSITIONS[current]:
        raise IllegalTransition(f"{current.value} -> {new.value} is not a legal move")
