"""Running under systemd: the unit file (unit.py) and the notify protocol (sdnotify.py)."""

from orchestrator.service.sdnotify import SystemdNotifier
from orchestrator.service.unit import install_unit, render_unit

__all__ = ["SystemdNotifier", "install_unit", "render_unit"]
