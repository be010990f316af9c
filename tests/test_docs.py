"""What the README and docs/ tell a user matches the code and the checkout.

README.md is one screen that leads into docs/; every page there answers one question,
named on its first lines. These checks keep that shape and keep the hand-written lists
(commands, reload fields, policies, paths) in step with the code they describe.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import pytest

from orchestrator.cli import build_parser
from orchestrator.config import APPLIED_AT_RELAUNCH, LB_POLICIES, NEEDS_DOWN_UP, flag

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README_MAX_LINES = 90  # one screen, give or take: the rest lives in docs/
PAGES = sorted(DOCS.glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path of this repository named in backquotes: `orchestrator/...`, `scripts/...`, ...
REPO_PATH = re.compile(r"`((?:orchestrator|scripts|tests|bench|demo|configs|docs)/[^`\s]*)`")


def read(path: Path) -> str:
    return path.read_text()


def section(text: str, heading: str) -> str:
    """From `heading` to the next heading of the same or a higher level, outside code."""
    start = text.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    out, fenced = [], False
    for i, line in enumerate(text[start:].splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        m = re.match(r"(#+) ", line)
        if i and m and not fenced and len(m.group(1)) <= level:
            break
        out.append(line)
    return "\n".join(out)


def links(path: Path) -> list[str]:
    """Relative link targets of a page, code blocks left out."""
    text = re.sub(r"```.*?```", "", read(path), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def test_readme_fits_a_screen() -> None:
    n = len(read(REPO / "README.md").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/ (limit {README_MAX_LINES})"


def test_readme_links_every_page_and_only_pages_that_exist() -> None:
    linked = {(REPO / t.split("#")[0]).resolve() for t in links(REPO / "README.md") if t.startswith("docs/")}
    missing = sorted(str(p.relative_to(REPO)) for p in linked if not p.is_file())
    assert missing == [], f"README links pages that do not exist: {missing}"
    orphans = sorted(p.name for p in PAGES if p.resolve() not in linked)
    assert orphans == [], f"docs pages the README's table of contents does not name: {orphans}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_starts_with_its_question(page: Path) -> None:
    """'# Title', a blank line, then the one question the page answers, in italics."""
    lines = read(page).splitlines()
    assert len(lines) > 4 and lines[0].startswith("# ") and lines[1] == "", \
        f"{page.name}: must begin with '# Title' and a blank line"
    question = []
    for line in lines[2:]:
        if not line:
            break
        question.append(line)
    q = " ".join(question)
    assert q.startswith("*") and q.endswith("?*"), f"{page.name}: line 3 must be the question, '*...?*'; got {q!r}"


@pytest.mark.parametrize("page", [REPO / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    """Links and pictures survive pages moving: the file exists, and so does a #heading."""
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            heads = {slug(h) for h in re.findall(r"^#+ (.+)$", read(dest), flags=re.M)}
            if anchor not in heads:
                broken.append(target)
    assert broken == [], f"{page.name}: broken links {broken}"


@pytest.mark.parametrize("page", [REPO / "README.md", *PAGES], ids=lambda p: p.name)
def test_paths_named_exist(page: Path) -> None:
    """Every repository path a page names in backquotes is in the checkout (globs match)."""
    missing = []
    for name in REPO_PATH.findall(read(page)):
        name = name.rstrip(".,;:")
        pattern = re.sub(r"\{[^}]*\}", "*", name)  # routing_bench-*.{json,png}
        if not glob.glob(str(REPO / pattern)):
            missing.append(name)
    assert missing == [], f"{page.name} names paths that do not exist: {missing}"


def test_readme_commands_are_the_scripts() -> None:
    """The two commands: one sets up and runs the demo, one sets up and runs the tests;
    every scripts/ command the README shows is an executable script of the checkout."""
    text = read(REPO / "README.md")
    two = section(text, "## The two commands")
    shown = re.findall(r"^\s{4}(scripts/[\w-]+)", two, flags=re.M)
    assert shown == ["scripts/demo", "scripts/test"], shown
    for name in set(re.findall(r"(?<![\w/.])(scripts/[\w-]+)", text)):
        path = REPO / name
        assert path.is_file() and os.access(path, os.X_OK), f"README names {name}: not an executable script"
    assert "scripts/bootstrap" in read(REPO / "scripts/demo") and "scripts/bootstrap" in read(REPO / "scripts/test")


def test_operations_names_every_command() -> None:
    """The commands table lists every subcommand the CLI has."""
    table = section(read(DOCS / "operations.md"), "## Commands")
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in sub.choices:
        assert re.search(rf"^\| `{re.escape(name)}\b", table, flags=re.M), f"`{name}` missing from docs/operations.md"


def test_operations_names_every_field_reload_refuses_or_applies_at_relaunch() -> None:
    """The reload table lives in config.py; the page's list is written by hand, so it is
    checked against the table (it had fallen 10 fields behind)."""
    text = section(read(DOCS / "operations.md"), "## What `reload` does with each setting")
    refused, relaunch = text.split("- at each instance's relaunch", 1)
    relaunch = relaunch.split("- at once", 1)[0]
    for name in NEEDS_DOWN_UP:
        assert f"`{flag(name)}`" in refused, f"{flag(name)} missing from docs/operations.md's refused list"
    for name in APPLIED_AT_RELAUNCH:
        assert f"`{flag(name)}`" in relaunch, f"{flag(name)} missing from docs/operations.md's at-relaunch list"


def test_routing_names_every_policy() -> None:
    text = read(DOCS / "routing.md")
    for policy in LB_POLICIES:
        assert re.search(rf"^\| `{re.escape(policy)}`", text, flags=re.M), \
            f"policy {policy} missing from docs/routing.md"


@pytest.mark.parametrize("readme", ["README.md", "bench/README.md", *(f"docs/{p.name}" for p in PAGES)])
def test_commands_run_the_checkouts_own_python(readme: str) -> None:
    """No command runs a Python by a path of the machine the text was written on; the
    benchmarks run with the checkout's .venv (bootstrap makes it)."""
    text = (REPO / readme).read_text()
    absolute = re.findall(r"(?<![\w.])/(?:root|home|usr|opt|tmp|work)/\S*python[\d.]*\b", text)
    assert absolute == [], absolute
    if readme == "bench/README.md":
        assert ".venv/bin/python -m bench." in text


def test_architecture_names_every_module_and_only_modules_that_exist() -> None:
    """docs/architecture.md's map of the package: a module added, moved or renamed must show
    there (the README's old layout had named files that no longer existed)."""
    text = read(DOCS / "architecture.md")
    modules = {p.name for p in (REPO / "orchestrator").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    unnamed = sorted(m for m in modules if not re.search(rf"(?<![\w/]){re.escape(m)}\b", text))
    assert unnamed == [], f"docs/architecture.md does not name: {unnamed}"
    tree = section(text, "## Folders")
    tree = tree[tree.index("orchestrator/"):tree.index("\nconfigs/")]  # the package's part
    named = set(re.findall(r"(?<![\w/.])(\w+\.py)\b", tree))
    assert sorted(named - modules) == [], \
        f"docs/architecture.md names modules that do not exist: {sorted(named - modules)}"
