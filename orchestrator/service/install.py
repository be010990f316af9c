"""`trtllm-orch install-service`: write the systemd unit for `up --config FILE`."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from orchestrator.config import Settings
from orchestrator.errors import EXIT_OK, UsageError
from orchestrator.service.unit import install_unit, render_unit

# What the unit passes to the instances: the stub and tritonserver find their
# libraries and Python packages through these (scripts/setup-triton sets them).
FORWARDED_ENV = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "CUDA_DEVICE_ORDER", "DEMO_TOKEN_DELAY_MS")


def install_service(args: argparse.Namespace, settings: Settings) -> int:
    if not args.config:
        raise UsageError("--config", "", "install-service needs the config file the service will read")
    config = Path(args.config).expanduser().absolute()
    exe = shutil.which("trtllm-orch") or os.path.join(os.path.dirname(sys.executable), "trtllm-orch")
    state_dir = str(settings.resolved_state_dir()) if settings.state_dir else "/run/trtllm-orch"
    environment = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    text = render_unit(config, os.path.abspath(exe), state_dir, environment, None,
                       stop_grace_s=settings.stop_grace_s)
    if args.dry_run:
        print(text, end="")
        return EXIT_OK
    path = install_unit(text, Path(args.unit_dir))
    print(f"wrote {path}\nnow run:\n  systemctl daemon-reload\n  systemctl enable --now {path.name}\n"
          f"  journalctl -u {path.name} -f")
    return EXIT_OK
