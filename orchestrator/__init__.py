"""trtllm-orch: a self-healing, load-balanced TensorRT-LLM service on one command."""

import hashlib
from pathlib import Path

# One place for the version: setup.cfg reads it; `release()` adds the build to it.
__version__ = "0.2.0"


def _code_digest() -> str:
    digest = hashlib.blake2b(digest_size=5)
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# Taken when the process imports the package (~5 ms), i.e. when it loads its code: read
# later, an upgrade that replaced the files would make an old process report the new code.
_RELEASE = f"{__version__}+{_code_digest()}"


def release() -> str:
    """The version and a digest of this package's code, e.g. "0.2.0+3f9c2a1b07".

    What `status` reports for the daemon, each data-plane worker and the code that started
    each engine. Processes outlive a daemon (live restore, `upgrade`), and two builds of one
    version differ: the digest tells an adopted worker on older code from its new daemon.
    """
    return _RELEASE
