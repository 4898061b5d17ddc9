"""The peers ModelRelay is compared with, each in front of the same fake upstream.

- LiteLLM's proxy (``litellm[proxy]``, pinned in ``requirements-bench.txt``), installed
  only into ``.bench-venv`` (created on first use, reused while the requirements file
  is unchanged). One uvicorn worker, no database, no master key, telemetry and
  per-request logging off, access log off.
- Debian's nginx as a plain reverse proxy: one worker process, upstream keep-alive,
  ``proxy_buffering off`` (so streamed chunks pass at once), access log off.

Both get temporary configs in the run's directory and are started and stopped by
the harness like every other process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.procs import Proc, Processes, free_port

ROOT = Path(__file__).resolve().parent.parent
BENCH_VENV = ROOT / ".bench-venv"
REQUIREMENTS = ROOT / "requirements-bench.txt"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


# --------------------------------------------------------------------------- bench venv


def ensure_bench_venv(log: Path) -> Path:
    """``.bench-venv`` with ``requirements-bench.txt`` installed; its python.

    Rebuilt only when the requirements file changed since the last install (its hash
    is stored in the venv), so later runs start at once.
    """
    python = BENCH_VENV / "bin" / "python"
    stamp = BENCH_VENV / ".requirements-sha256"
    wanted = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text().strip() == wanted:
        return python
    print(f"creating {BENCH_VENV.name} (LiteLLM and py-spy; first run only) ...", flush=True)
    started = time.monotonic()
    with open(log, "ab") as out:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-q",
                "-r",
                str(REQUIREMENTS),
            ],
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    stamp.write_text(wanted + "\n")
    print(f"  {BENCH_VENV.name} ready in {time.monotonic() - started:.0f} s", flush=True)
    return python


def pinned_version(package: str) -> str:
    for line in REQUIREMENTS.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and name.split("[", 1)[0].strip().lower() == package:
            return version.split(";", 1)[0].strip()
    return "?"


def nginx_version() -> str:
    try:
        out = subprocess.run([NGINX, "-v"], capture_output=True, text=True, timeout=10)
    except OSError:
        return "not installed"
    return (out.stderr or out.stdout).strip().rsplit("/", 1)[-1]


# --------------------------------------------------------------------------- readiness


def wait_http(url: str, proc: Proc, timeout: float) -> None:
    """Wait until ``GET url`` answers 200 (the process must stay alive meanwhile)."""
    deadline = time.monotonic() + timeout
    problem = ""
    while time.monotonic() < deadline:
        if not proc.alive():
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:
            problem = str(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready at {url} ({problem}):\n{proc.tail()}")


# --------------------------------------------------------------------------- LiteLLM

_UVICORN_LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
    "handlers": {
        "stderr": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stderr",
        }
    },
    "loggers": {
        "uvicorn": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
        "uvicorn.error": {"level": "WARNING"},
        "uvicorn.access": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
    },
}


def litellm_config(upstream_url: str) -> str:
    """The proxy's config: one openai-compatible model on the fake upstream."""
    return "\n".join(
        [
            "model_list:",
            "  - model_name: bench-model",
            "    litellm_params:",
            "      model: openai/bench-model",
            f"      api_base: {upstream_url}/v1",
            "      api_key: sk-bench",
            "litellm_settings:",
            "  telemetry: false",
            "  turn_off_message_logging: true",
            "  set_verbose: false",
            "  json_logs: false",
            "  callbacks: []",
            "general_settings:",
            "  disable_spend_logs: true",
            "  disable_error_logs: true",
            "  disable_adding_master_key_hash_to_db: true",
            "",
        ]
    )


def start_litellm(
    procs: Processes, bench_python: Path, upstream_url: str, workdir: Path, cpus: str | None
) -> tuple[Proc, int]:
    config = workdir / "litellm.yaml"
    config.write_text(litellm_config(upstream_url))
    log_config = workdir / "litellm-logging.json"
    log_config.write_text(json.dumps(_UVICORN_LOGGING))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LITELLM_", "DATABASE_"))}
    env.update(
        {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the price list at start
            "LITELLM_LOG": "ERROR",
            "LITELLM_TELEMETRY": "False",
            "DISABLE_SCHEMA_UPDATE": "True",
            "HOME": str(workdir),
        }
    )
    env.pop("REDIS_URL", None)
    litellm = bench_python.parent / "litellm"
    proc = procs.start(
        "litellm",
        [
            str(litellm),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
            "--log_config",
            str(log_config),
        ],
        env=env,
        cwd=workdir,
        cpus=cpus,
    )
    wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, timeout=120)
    return proc, port


# --------------------------------------------------------------------------- nginx


def nginx_config(upstream_port: int, port: int, workdir: Path) -> str:
    return f"""\
daemon off;
master_process on;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/nginx-body;
    proxy_temp_path {workdir}/nginx-proxy;
    fastcgi_temp_path {workdir}/nginx-fastcgi;
    uwsgi_temp_path {workdir}/nginx-uwsgi;
    scgi_temp_path {workdir}/nginx-scgi;
    upstream fake {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://fake;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
        location = /nginx-health {{ return 200 "ok"; }}
    }}
}}
"""


def start_nginx(
    procs: Processes, upstream_port: int, workdir: Path, cpus: str | None
) -> tuple[Proc, int]:
    port = free_port()
    config = workdir / "nginx.conf"
    config.write_text(nginx_config(upstream_port, port, workdir))
    proc = procs.start(
        "nginx",
        [NGINX, "-p", str(workdir), "-c", str(config), "-e", str(workdir / "nginx-error.log")],
        cwd=workdir,
        cpus=cpus,
    )
    wait_http(f"http://127.0.0.1:{port}/nginx-health", proc, timeout=30)
    return proc, port
