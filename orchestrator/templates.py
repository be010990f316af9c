"""Where the Jinja templates in `configs/` live, and one way to load them.

A source checkout keeps them in the repo-root `configs/` next to the package; an
installed package gets them under `<sys.prefix>/share/trtllm-orch/configs` (setup.cfg
data_files). Undefined variables raise instead of rendering as empty strings: an
empty `listen` in nginx.conf is a far worse failure than a traceback in a test.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import jinja2

from orchestrator.errors import EnvironmentProblem

_MARKER = "nginx.conf.j2"  # any template we ship; proves the directory is ours


def configs_dir() -> Path:
    candidates = (
        Path(__file__).resolve().parent.parent / "configs",
        Path(sys.prefix) / "share" / "trtllm-orch" / "configs",
    )
    for candidate in candidates:
        if (candidate / _MARKER).is_file():
            return candidate
    raise EnvironmentProblem(
        "templates: no configs directory with " + _MARKER + " in " + " or ".join(str(c) for c in candidates))


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(configs_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # nginx.conf and unit files, not HTML
    )


def render(name: str, **context: object) -> str:
    return environment().get_template(name).render(**context)
