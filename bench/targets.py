"""What a benchmark sends its load to: the upstream directly, ModelRelay, or a peer.

Each target is started for its own measurements and stopped afterwards, so nothing
else runs on the system-under-test core while it is measured. ``cpu_pids`` names the
processes whose CPU time the report attributes to the target.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench import peers
from bench.procs import Proc, Processes, group_pids

ROOT = Path(__file__).resolve().parent.parent
WORKER_SECRET = "mrw_bench-secret-0123456789abcdef"
MODEL = "bench-model"
#: ModelRelay deployments measured: CLI name -> (label in the results, ``serve --server``).
RELAYS = {
    "modelrelay": ("ModelRelay", "daphne"),
    "modelrelay-uvicorn": ("ModelRelay (uvicorn)", "uvicorn"),
}


def project_python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


@dataclass
class Target:
    name: str
    port: int = 0
    procs: list[Proc] = field(default_factory=list)
    cpu_pids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# --------------------------------------------------------------------------- ModelRelay


def server_env(data_dir: Path, **overrides: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MODELRELAY_", "DJANGO_"))
        and k not in ("REDIS_URL", "DATABASE_URL", "ASGI_SERVER")
    }
    env.update(
        {
            "DATA_DIR": str(data_dir),
            "DATABASE_URL": f"sqlite:///{data_dir / 'db.sqlite3'}",
            "WORKER_SECRET": WORKER_SECRET,
            "PROVIDER_NAME": "local",
            "LOG_LEVEL": "warning",
            "MAX_QUEUE_LEN": "2000",
            "PYTHONUNBUFFERED": "1",
            "SHUTDOWN_GRACE_SECS": "2",
        }
    )
    env.update(overrides)
    return env


def health(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url + "/health", timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def wait_workers(url: str, count: int, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    seen: object = None
    while time.monotonic() < deadline:
        if not proc.alive():
            break
        seen = health(url).get("workers_connected")
        if seen == count:
            return
        time.sleep(0.1)
    raise RuntimeError(f"expected {count} connected workers, have {seen}:\n{proc.tail()}")


def start_server(
    procs: Processes, workdir: Path, label: str, cpus: str | None, server: str, **env: str
) -> tuple[Proc, str]:
    """``manage.py serve --server <server>`` on a fresh SQLite ``DATA_DIR``; its URL."""
    data_dir = workdir / f"data-{label}"
    data_dir.mkdir()
    proc = procs.start(
        f"server-{label}",
        [project_python(), "manage.py", "serve", "--listen", "127.0.0.1:0", "--server", server],
        env=server_env(data_dir, **env),
        cwd=ROOT,
        cpus=cpus,
    )
    match = proc.wait_for_line(r"Listening on (http://\S+)", timeout=90)
    return proc, match.group(1)


def start_workers(
    procs: Processes,
    server_url: str,
    backend_url: str,
    count: int,
    label: str,
    max_concurrent: int = 512,
) -> list[Proc]:
    workers = []
    for i in range(count):
        workers.append(
            procs.start(
                f"worker-{label}-{i + 1}",
                [
                    project_python(),
                    "worker.py",
                    "--proxy-url",
                    server_url,
                    "--worker-secret",
                    WORKER_SECRET,
                    "--backend-url",
                    backend_url,
                    "--models",
                    MODEL,
                    "--max-concurrent",
                    str(max_concurrent),
                    "--worker-name",
                    f"bench-worker-{i + 1}",
                    "--log-level",
                    "warning",
                ],
                cwd=ROOT,
            )
        )
    return workers


def start_modelrelay(
    procs: Processes,
    workdir: Path,
    upstream_url: str,
    workers: int,
    cpus: str | None,
    name: str = "modelrelay",
    label: str | None = None,
    env: dict[str, str] | None = None,
) -> Target:
    """One ModelRelay deployment of :data:`RELAYS`: the server and ``workers`` worker.py.

    ``label`` names its data directory and logs (default: ``name``) when one run
    starts the same deployment more than once; ``env``: settings of the server's own.
    """
    tag = label or name
    label, server_name = RELAYS[name]
    server, url = start_server(procs, workdir, tag, cpus, server_name, **(env or {}))
    worker_procs = start_workers(procs, url, upstream_url, workers, tag)
    wait_workers(url, workers, server, timeout=60)
    target = Target(label, int(url.rsplit(":", 1)[1]), [server, *worker_procs])
    target.cpu_pids = {"server": [server.pid], "workers": [w.pid for w in worker_procs]}
    return target


# --------------------------------------------------------------------------- peers


def direct(upstream_port: int) -> Target:
    return Target("direct", upstream_port)


def start_litellm(
    procs: Processes, bench_python: Path, workdir: Path, upstream_url: str, cpus: str | None
) -> Target:
    proc, port = peers.start_litellm(procs, bench_python, upstream_url, workdir, cpus)
    return Target("LiteLLM", port, [proc], {"litellm": group_pids(proc.pid)})


def start_nginx(procs: Processes, workdir: Path, upstream_port: int, cpus: str | None) -> Target:
    proc, port = peers.start_nginx(procs, upstream_port, workdir, cpus)
    return Target("nginx", port, [proc], {"nginx": group_pids(proc.pid)})


def stop(procs: Processes, target: Target) -> None:
    for proc in reversed(target.procs):
        procs.stop(proc)
