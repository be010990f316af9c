"""The code runs on Python 3.10 to 3.13, checked statically (only one Python runs the suite).

NVIDIA's TRT-LLM Triton containers (24.04 to 24.11) ship Python 3.10, so nothing
newer may be used: no tomllib without the tomli fallback, no asyncio.TaskGroup,
asyncio.timeout, except*, typing.Self, enum.StrEnum, datetime.UTC, ...
vermin (a test extra) knows which version introduced each module, member, keyword
argument and syntax; it runs in-process here, on one process (a unit test spawns nothing).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
OLDEST = (3, 10)
# Everything that runs: the package, the demo model (inside tritonserver's Python
# backend), the Python scripts (by their #! line), the benches and the tests.
CHECKED = ("orchestrator", "demo", "scripts", "bench", "tests")


def _vermin():
    try:
        import vermin
    except ImportError:  # pragma: no cover - bootstrap installs the test extras
        pytest.fail("vermin is not installed: run scripts/bootstrap (it installs .[test])")
    return vermin


def _too_new(vermin, paths: list[str], root: Path = REPO) -> dict[str, str]:
    """{file relative to root: what in it needs a Python newer than OLDEST}."""
    config = vermin.Config()
    config.set_eval_annotations(True)  # settings and templates may evaluate annotations at run time
    config.set_verbose(3)  # output_text() names each requirement with its line
    config.set_show_tips(False)
    config.set_processes(1)
    config.set_pessimistic(True)  # a syntax error (on the Python running this) is a failure, not "no requirement"
    files = vermin.detect_paths(paths, processes=1, config=config)
    assert files, f"vermin found no Python file under {paths}"
    out = {}
    for path in sorted(set(files)):
        source = Path(path).read_bytes()
        visitor = vermin.visit(source, config, path)
        mins = visitor if isinstance(visitor, list) else visitor.minimum_versions()
        py3 = mins[1]
        if py3 is None or tuple(py3) > OLDEST:  # None: cannot run on this Python 3 at all
            why = visitor.output_text() if not isinstance(visitor, list) else \
                f"does not parse on the Python running the tests ({sys.version.split()[0]})"
            lines = [ln.strip() for ln in why.splitlines() if re.search(r"\b3\.1[1-9]\b", ln)]
            out[str(Path(path).relative_to(root))] = "; ".join(lines) or why.strip()
    return out


def test_every_python_file_runs_on_3_10():
    vermin = _vermin()
    too_new = _too_new(vermin, [str(REPO / d) for d in CHECKED])
    assert too_new == {}, "needs a Python newer than 3.10:\n" + "\n".join(f"  {p}: {w}" for p, w in too_new.items())


def test_the_check_sees_3_11_features(tmp_path):
    """The check is not vacuous: each feature the codebase once used is caught."""
    vermin = _vermin()
    cases = {
        "toml.py": "import tomllib\n",
        "group.py": "import asyncio\nasync def f():\n    async with asyncio.TaskGroup() as tg:\n        pass\n",
        "star.py": "try:\n    pass\nexcept* ValueError:\n    pass\n",
        "timeout.py": "import asyncio\nasync def f():\n    async with asyncio.timeout(1):\n        pass\n",
    }
    for name, src in cases.items():
        (tmp_path / name).write_text(src)
    (tmp_path / "fallback.py").write_text(
        "import sys\nif sys.version_info >= (3, 11):\n    import tomllib\nelse:\n    import tomli as tomllib\n")
    too_new = _too_new(vermin, [str(tmp_path)], root=tmp_path)
    assert set(too_new) == set(cases), too_new


def test_python_requires_admits_3_10():
    text = (REPO / "setup.cfg").read_text()
    assert re.search(r"^python_requires\s*=\s*>=3\.10\s*$", text, re.M), "setup.cfg python_requires"
    assert re.search(r'^\s*tomli>=[\d.]+;\s*python_version\s*<\s*"3\.11"\s*$', text, re.M), \
        "setup.cfg install_requires needs the tomli fallback for 3.10"
