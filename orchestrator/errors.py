"""Errors a user can cause, and the exit codes they map to.

Every user-facing failure names the field and the value in one line, so that a
person reading a systemd journal knows what to fix without reading a traceback.
"""

EXIT_OK = 0
EXIT_RUNTIME = 1  # something failed while running (an instance, the daemon)
EXIT_USAGE = 2  # bad input: nothing was started


class OrchError(Exception):
    """Base for errors that end a command with a one-line message."""

    exit_code = EXIT_RUNTIME


class UsageError(OrchError):
    """Bad input from the command line or config file. Nothing was started."""

    exit_code = EXIT_USAGE

    def __init__(self, field: str, value: object, why: str):
        self.field = field
        self.value = value
        self.why = why
        super().__init__(f"{field}={value!r}: {why}")


class EnvironmentProblem(OrchError):
    """The host lacks something we need (mpirun, tritonserver, NVML, a free port)."""

    exit_code = EXIT_USAGE


class DaemonNotRunning(OrchError):
    exit_code = EXIT_RUNTIME
