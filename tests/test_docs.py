"""What the READMEs tell a user to type matches the code and runs on the user's checkout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.config import APPLIED_AT_RELAUNCH, NEEDS_DOWN_UP, flag

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:end if end != -1 else None]


def test_readme_names_every_field_reload_refuses_or_applies_at_relaunch() -> None:
    """The reload table lives in config.py; the README's list is written by hand, so it is
    checked against the table (it had fallen 10 fields behind)."""
    text = section((REPO / "README.md").read_text(), "### What `reload` does with each setting")
    refused, relaunch = text.split("- at each instance's relaunch", 1)
    relaunch = relaunch.split("- at once", 1)[0]
    for name in NEEDS_DOWN_UP:
        assert f"`{flag(name)}`" in refused, f"{flag(name)} missing from the README's refused list"
    for name in APPLIED_AT_RELAUNCH:
        assert f"`{flag(name)}`" in relaunch, f"{flag(name)} missing from the README's at-relaunch list"


@pytest.mark.parametrize("readme", ["README.md", "bench/README.md"])
def test_commands_run_the_checkouts_own_python(readme: str) -> None:
    """No command runs a Python by a path of the machine the text was written on; the
    benchmarks run with the checkout's .venv (bootstrap makes it)."""
    text = (REPO / readme).read_text()
    absolute = re.findall(r"(?<![\w.])/(?:root|home|usr|opt|tmp|work)/\S*python[\d.]*\b", text)
    assert absolute == [], absolute
    if readme == "bench/README.md":
        assert ".venv/bin/python -m bench." in text
