"""The relay core and the worker run without Django."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORE = [
    "relay",
    "relay.config",
    "relay.protocol",
    "relay.errors",
    "relay.registry",
    "relay.queue",
    "relay.request",
    "relay.dispatch",
    "relay.fleet",
    "relay.sse",
    "relay.headers",
    "relay.ratelimit",
    "relay.stats",
    "relay.credentials",
    "relay.cors",
    "relay.timeline",
    "relay.recipes",
    "relay.bundle",
    "relay.workerconfig",
    "relay.usage",
    "relay.backend",
    "relay.network",
    "relay.session",
]


def test_core_and_worker_import_no_django():
    code = (
        "import importlib, sys\n"
        f"for name in {CORE!r} + ['worker']:\n"
        "    importlib.import_module(name)\n"
        "prefixes = ('django', 'channels', 'daphne')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in prefixes)\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
