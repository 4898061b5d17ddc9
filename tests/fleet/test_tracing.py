"""When tracing is on, and that it costs nothing when it is off (SPEC §17)."""

from __future__ import annotations

import os
import subprocess
import sys

from relay.server.tracing import from_environment
from relay.wire.telemetry import exporters
from tests.live import ROOT


def test_tracing_is_off_unless_the_standard_environment_asks_for_it() -> None:
    assert exporters({}) == []
    assert exporters({"OTEL_SERVICE_NAME": "relay"}) == []
    assert exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) == ["otlp"]
    assert exporters({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ["otlp"]
    assert exporters({"OTEL_TRACES_EXPORTER": "console,otlp"}) == ["console", "otlp"]
    assert exporters({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) == []
    disabled = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert exporters(disabled) == []
    assert from_environment({}) is None


def test_with_tracing_off_no_tracing_module_is_loaded_by_server_or_worker() -> None:
    # (redis-py loads parts of the OpenTelemetry SDK for its own metrics when it is
    # installed; the relay's tracing must not add the tracer, propagator or exporter.)
    code = (
        "TRACING = ('opentelemetry.sdk.trace', 'opentelemetry.exporter', "
        "'opentelemetry.trace.propagation.tracecontext')\n"
        "import os, sys, django\n"
        "os.environ['DJANGO_SETTINGS_MODULE'] = 'modelrelay_site.settings'\n"
        "django.setup()\n"
        "import asyncio\n"
        "import relay.server.http.app, relay.server.runtime, worker\n"
        "async def main():\n"
        "    from relay.server.runtime import Runtime\n"
        "    rt = Runtime(asyncio.get_running_loop())\n"
        "    assert rt.tracing is None and rt.relay.tracer is None\n"
        "    await rt.aclose()\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m.startswith(TRACING)))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
