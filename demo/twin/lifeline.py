"""The engine dies with its server, as TensorRT-LLM's does.

TensorRT-LLM's engine runs inside tritonserver, so a SIGKILLed rank takes its
engine with it at once, and mpirun, seeing the rank gone, ends the job. The
twin's engine runs in a Python-backend stub instead, and a stub that outlives its
server holds the rank's output pipe, so mpirun waits for it and the job never ends.

Triton's stub notices a dead server only on its next 300 ms health poll, and then
runs its destructors under the GIL. A watcher thread inside the stub needs the GIL
too. Both hang when another stub thread is blocked in a pb_utils call to the dead
server: a worker rank's metric `set` is a round trip over shared memory, and it
waits on a futex forever while it holds the GIL. With a watcher thread, about 1 kill -9
in 8 of a worker rank's server, right after a SIGSTOP/SIGCONT, left the job alive
for more than 60 s.

So the watch runs in a process of its own. It is a child forked at initialize,
before CUDA is touched. It closes every descriptor it inherited, so it holds no
pipe, socket or shared-memory file, and the stub waits for that before it goes on
(a check that read the watcher's descriptors right after the fork once found the
pipe still open). Then it waits on pidfds of the server and the stub. When the
server ends first, it SIGKILLs the stub. When the stub ends, it leaves.
It keeps the rank's environment, so whatever finds a group's processes by
their tag finds it too.
"""
import os
import select
import signal
import threading
import warnings


def exit_with_server():
    """Fork the watcher of this stub's server (its parent); the stub reaps it when it leaves."""
    stub = os.getpid()
    try:
        server_fd = os.pidfd_open(os.getppid())
    except ProcessLookupError:      # the server is already gone: so are we
        os._exit(1)
    stub_fd = os.pidfd_open(stub)
    # Closed by the watcher once it has dropped what it inherited: the stub goes on (and reports
    # ready) only then, so no moment exists where the watcher still holds the rank's output pipe.
    dropped, done = os.pipe()
    # Python 3.12 warns that forking a process with threads may deadlock the child (on a lock
    # another thread held). The child only closes descriptors, waits and kills: no lock of
    # the stub's threads is taken there, and the GIL and malloc are reset by fork itself.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        watcher = os.fork()
    if watcher == 0:
        _watch(server_fd, stub_fd, stub, done)
    os.close(server_fd)
    os.close(stub_fd)
    os.close(done)
    os.read(dropped, 1)  # b"": end of file, the watcher's write end closed
    os.close(dropped)
    # waitpid blocks without the GIL; the thread ends when the watcher does.
    threading.Thread(target=os.waitpid, args=(watcher, 0), name="twin-lifeline", daemon=True).start()


def _watch(server_fd, stub_fd, stub, done):
    """The watcher process: never returns."""
    try:
        _drop_inherited(keep=(server_fd, stub_fd, done))
        os.close(done)
        ready, _, _ = select.select([server_fd, stub_fd], [], [])
        if stub_fd not in ready:
            os.kill(stub, signal.SIGKILL)
    finally:
        os._exit(0)


def _drop_inherited(keep):
    """Point stdio at /dev/null and close every other descriptor but `keep`."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:         # the listing's own descriptor, already closed
                pass
