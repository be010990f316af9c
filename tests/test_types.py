"""The package type-checks: mypy over orchestrator/ with setup.cfg's [mypy] settings finds nothing.

Annotations are the modules' documentation of what flows between them (a Backend's health, a
policy's turns, a shared lane); one that is narrower than what runs misleads the next reader, and
mypy is what notices. It runs in-process (mypy.api: no child process, as a unit test must), with
its cache in the test's temporary directory: about 30 s on the 2-core box (the GPU machine runs
mypy's pure wheel, which scripts/pack-gpu-payload carries there).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent


def test_the_package_type_checks(tmp_path, monkeypatch):
    try:
        from mypy import api
    except ImportError:  # pragma: no cover - bootstrap installs the test extras
        pytest.fail("mypy is not installed: run scripts/bootstrap (it installs .[test])")
    monkeypatch.chdir(REPO)  # setup.cfg's [mypy] sections are found from here
    out, err, status = api.run(["--config-file", str(REPO / "setup.cfg"), "--cache-dir", str(tmp_path / "cache"),
                                "--no-error-summary", "orchestrator"])
    findings = [line for line in out.splitlines() if ": error:" in line]
    assert status == 0 and not findings, "\n".join(findings) or out + err
