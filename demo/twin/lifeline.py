"""The engine dies with its server, as TensorRT-LLM's does.

TensorRT-LLM's engine runs inside tritonserver, so a SIGKILLed rank takes its
engine with it at once, and mpirun, seeing the rank gone, ends the job. The
twin's engine runs in a Python-backend stub instead. Triton's stub notices a dead
server only on its next 300 ms health poll and then runs its destructors before
exiting; in about 1 run of 30 we saw a worker rank's stub stay alive after that
(blocked in a futex), holding the rank's output pipe, so mpirun waited for it
and the job never ended. So each engine stub watches its server itself and
leaves with os._exit, running nothing, within one poll of the server's death.
"""
import os
import threading
import time

POLL_S = 0.05


def exit_with_server(poll_s=POLL_S):
    """Start a daemon thread that ends this process once its parent (the server) is gone."""
    server = os.getppid()

    def watch():
        while os.getppid() == server:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="twin-lifeline", daemon=True).start()
