"""The deployment files, checked by reading and by their own tools: ``nginx -t`` on the
production config, ``caddy adapt``, the Dockerfile's targets, the compose file, the
systemd units, the env examples, docs/DEPLOY.md and ``manage.py check --deploy`` with the
example env. The Docker engine is not needed (nor available on CI).
"""

from __future__ import annotations

import ast
import datetime as dt
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.live import ROOT
from tests.test_deploy_proxies import (
    caddy_binary,
    nginx_binary,
    nginx_command,
    nginx_main_config,
    render_production,
)

DEPLOY = ROOT / "deploy"
NGINX_CONF = DEPLOY / "nginx.conf"
SERVER_ENV = DEPLOY / "modelrelay.env.example"
WORKER_ENV = DEPLOY / "worker.env.example"
SECRETISH = re.compile(r"SECRET|PASSWORD|TOKEN|PEPPER")


def self_signed_pair(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relay.example.com")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "fullchain.pem", directory / "privkey.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_nginx_accepts_the_production_config(tmp_path):
    binary = nginx_binary()
    cert, key = self_signed_pair(tmp_path)
    conf = nginx_main_config(tmp_path, render_production(cert, key))
    result = subprocess.run(
        [*nginx_command(binary, tmp_path, conf), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_nginx_accepts_the_compose_cluster_config(tmp_path):
    binary = nginx_binary()
    # Inside compose `server` resolves to the replicas; here to nothing, so use loopback.
    site = (DEPLOY / "nginx-compose-cluster.conf").read_text()
    site = site.replace("server server:8080;", "server 127.0.0.1:8080;")
    conf = nginx_main_config(tmp_path, site)
    result = subprocess.run(
        [*nginx_command(binary, tmp_path, conf), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr


def test_the_compose_cluster_override_scales_the_server_behind_nginx():
    text = (ROOT / "docker-compose.cluster.yml").read_text()
    assert "./deploy/nginx-compose-cluster.conf:" in text
    assert "ports: !reset []" in text  # replicas cannot all publish one host port
    for shared in ("MODELRELAY_SECRET_PEPPER", "DJANGO_SECRET_KEY"):
        assert f"${{{shared}:?" in text  # required, never committed
    assert "PROXY_URL: http://front:8080" in text


def test_caddy_accepts_the_caddyfile():
    text = (DEPLOY / "Caddyfile").read_text()
    assert re.search(r"^\treverse_proxy 127\.0\.0\.1:8080 \{$", text, re.M)
    # An explicit `flush_interval -1` makes Caddy ignore client hang-ups (the upstream
    # request, and so the generation, would run on); SSE is flushed at once without it.
    assert not re.search(r"^\s*flush_interval", text, re.M)
    result = subprocess.run(
        [caddy_binary(), "adapt", "--config", str(DEPLOY / "Caddyfile"), "--adapter", "caddyfile"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert '"dial":"127.0.0.1:8080"' in result.stdout.replace(" ", "")


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """``{stage: [(INSTRUCTION, arguments), ...]}`` in file order (continuations joined)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", args.strip(), re.I)
            assert match, f"every stage needs a name: FROM {args}"
            current = stages.setdefault(match.group(2), [])
        if current is not None:
            current.append((instruction, " ".join(args.split())))
    return stages


def test_the_dockerfile_builds_a_non_root_server_by_default_and_a_worker_target():
    stages = dockerfile_stages()
    assert list(stages)[-1] == "server", "the server must be the default (last) target"
    assert "worker" in stages
    for name in ("server", "worker"):
        users = [args for instruction, args in stages[name] if instruction == "USER"]
        assert users, f"{name} stage has no USER"
        assert users[-1].split(":")[0] not in ("root", "0"), users[-1]
        base = stages[name][0][1].split()[0]
        assert base == "${PYTHON_IMAGE}", base
    assert re.search(
        r"^ARG PYTHON_IMAGE=python:3\.11-slim\b", (ROOT / "Dockerfile").read_text(), re.M
    )

    server = dict(stages["server"]) | {
        "ENV": " ".join(a for i, a in stages["server"] if i == "ENV")
    }
    assert "DATA_DIR=/data" in server["ENV"].split()
    assert "LISTEN_ADDR=0.0.0.0:8080" in server["ENV"].split()
    assert server["EXPOSE"] == "8080"
    assert "/data" in server["VOLUME"]
    assert "python" in server["HEALTHCHECK"] and "/health" in server["HEALTHCHECK"]
    assert json.loads(server["ENTRYPOINT"]) == ["python", "manage.py", "serve"]
    assert json.loads(dict(stages["worker"])["ENTRYPOINT"]) == ["python", "worker.py"]
    copies = [a for i, a in stages["server"] if i == "COPY" and "--from" not in a]
    assert copies == [". ."]
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".venv", "var", ".test-data", ".git", ".mypy_cache", "**/__pycache__"):
        assert entry in ignored, entry


def worker_stage_files() -> list[str]:
    files: list[str] = []
    for instruction, args in dockerfile_stages()["worker"]:
        if instruction == "COPY" and "--from" not in args:
            *sources, _dest = args.split()
            files += sources
    return files


def test_the_worker_target_holds_everything_worker_py_needs(tmp_path):
    if not (ROOT / "worker.py").exists():
        pytest.skip("worker.py is not written yet")
    files = worker_stage_files()
    assert "worker.py" in files and "requirements-worker.txt" in files
    assert not any(f.startswith("manage") or f in (".", "relay/") for f in files), files
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(ROOT / name, tmp_path / name)
    # Only the copied files are importable from there (the venv has no path to the repo).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE")}
    result = subprocess.run(
        [sys.executable, "worker.py", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    # Every third-party import of those files is pinned in requirements-worker.txt.
    wanted = {
        line.split("==")[0].split("[")[0].strip().lower().replace("-", "_")
        for line in (ROOT / "requirements-worker.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    imported: set[str] = set()
    for name in files:
        if name.endswith(".py"):
            for node in ast.walk(ast.parse((ROOT / name).read_text())):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"__future__", "relay", "worker"}
    assert third_party <= wanted, third_party - wanted


# --------------------------------------------------------------------------- compose


def parse_block_yaml(text: str) -> Any:
    """The block-style YAML subset docker-compose.yml keeps to: mappings, sequences of
    scalars, plain or quoted scalars, full-line comments. Anything else is an error."""
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        assert "\t" not in raw, f"line {number}: tab"
        lines.append((len(raw) - len(raw.lstrip(" ")), raw.strip(), number))

    def scalar(value: str) -> str | None:
        if value == "":
            return None
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            return value[1:-1]
        assert value[0] not in "[{&*!|>'\"", f"unsupported YAML value {value!r}"
        return value

    def block(i: int, indent: int) -> tuple[Any, int]:
        if lines[i][1].startswith("- "):
            items: list[Any] = []
            while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
                items.append(scalar(lines[i][1][2:].strip()))
                i += 1
            return items, i
        mapping: dict[str, Any] = {}
        while i < len(lines) and lines[i][0] == indent:
            _, content, number = lines[i]
            key, sep, value = content.partition(":")
            assert sep and key and " " not in key.strip(), f"line {number}: {content!r}"
            assert key not in mapping, f"line {number}: duplicate key {key!r}"
            value = value.strip()
            i += 1
            if value == "" and i < len(lines) and lines[i][0] > indent:
                mapping[key], i = block(i, lines[i][0])
            else:
                mapping[key] = scalar(value)
        assert i == len(lines) or lines[i][0] < indent, f"line {lines[i][2]}: bad indent"
        return mapping, i

    document, end = block(0, 0)
    assert end == len(lines)
    return document


def test_compose_runs_server_postgres_redis_and_a_worker_without_committed_secrets():
    text = (ROOT / "docker-compose.yml").read_text()
    services = parse_block_yaml(text)["services"]
    assert set(services) == {"server", "postgres", "redis", "worker"}
    server, worker = services["server"], services["worker"]
    assert server["build"]["target"] == "server" and worker["build"]["target"] == "worker"

    env = server["environment"]
    assert re.fullmatch(
        r"postgres://modelrelay:\$\{POSTGRES_PASSWORD:\?[^}]+\}@postgres:5432/modelrelay",
        env["DATABASE_URL"],
    )
    assert env["REDIS_URL"] == "redis://redis:6379/0"
    assert env["WORKER_SECRET"].startswith("${WORKER_SECRET:?")
    assert server["volumes"] == ["relay-data:/data"]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert int(server["stop_grace_period"].rstrip("s")) > default_setting("SHUTDOWN_GRACE_SECS")

    postgres = services["postgres"]
    assert postgres["image"] == "postgres:16"
    assert postgres["volumes"] == ["postgres-data:/var/lib/postgresql/data"]
    assert "pg_isready" in postgres["healthcheck"]["test"]
    assert services["redis"]["image"] == "redis:7"

    wenv = worker["environment"]
    assert wenv["PROXY_URL"] == "http://server:8080"
    assert wenv["BACKEND_URL"] == "http://host.docker.internal:8000"
    assert wenv["MODELS"]
    assert worker["extra_hosts"] == ["host.docker.internal:host-gateway"]
    assert int(worker["stop_grace_period"].rstrip("s")) > default_setting("REQUEST_TIMEOUT_SECS")

    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            if SECRETISH.search(key):
                assert re.fullmatch(r"\$\{\w+:[?-][^}]*\}", value or ""), (name, key, value)


def test_the_compose_sentinel_override_finds_the_master_through_three_sentinels():
    services = parse_block_yaml((ROOT / "docker-compose.sentinel.yml").read_text())["services"]
    sentinels = [f"sentinel-{n}" for n in (1, 2, 3)]
    assert set(services) == {"server", "redis", "redis-replica", *sentinels}
    env = services["server"]["environment"]
    assert env["REDIS_URL"] == ""  # replaced: never both
    assert env["REDIS_SENTINELS"].split(",") == [f"{name}:26379" for name in sentinels]
    monitor = re.search(
        r"^sentinel monitor (\S+) (\S+) (\d+) (\d+)$",
        (DEPLOY / "redis-sentinel.conf").read_text(),
        re.MULTILINE,
    )
    assert monitor is not None
    assert monitor.groups() == (env["REDIS_SENTINEL_MASTER"], "redis", "6379", "2")
    for name in ("redis", "redis-replica"):
        assert "--min-replicas-to-write 1" in services[name]["command"], name
    assert "--replicaof redis 6379" in services["redis-replica"]["command"]
    for name in sentinels:
        sentinel = services[name]
        assert (
            "./deploy/redis-sentinel.conf:/etc/modelrelay/sentinel.conf:ro" in sentinel["volumes"]
        )
        assert f"{name}:/data" in sentinel["volumes"]  # its own copy, which it rewrites
        assert "--sentinel" in sentinel["command"]
        assert services["server"]["depends_on"][name]["condition"] == "service_healthy"


def test_sentinel_accepts_the_sentinel_config(tmp_path):
    """deploy/redis-sentinel.conf, its master moved to a local redis-server: the sentinel
    starts with it and monitors that master under the name and quorum it gives."""
    from tests.sentinelkit import free_ports, wait_for

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    master, sentinel = free_ports(2)
    conf = (DEPLOY / "redis-sentinel.conf").read_text()
    conf = conf.replace(
        "sentinel monitor modelrelay redis 6379", f"sentinel monitor modelrelay 127.0.0.1 {master}"
    )
    conf = conf.replace("port 26379", f"port {sentinel}").replace("dir /data", f"dir {tmp_path}")
    (tmp_path / "sentinel.conf").write_text(conf)
    import redis

    started = [
        subprocess.Popen(
            [binary, "--port", str(master), "--save", "", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [binary, str(tmp_path / "sentinel.conf"), "--sentinel"], stdout=subprocess.DEVNULL
        ),
    ]
    try:
        with redis.Redis(port=sentinel, socket_timeout=2, decode_responses=True) as client:
            state = wait_for(
                lambda: client.execute_command("SENTINEL", "MASTER", "modelrelay"),
                10,
                "the sentinel",
            )
        assert int(state["quorum"]) == 2 and int(state["down-after-milliseconds"]) == 5000
        assert int(state["port"]) == master
    finally:
        for process in started:
            process.kill()
            process.wait(5)


# --------------------------------------------------------------------------- systemd


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in (DEPLOY / name).read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def default_setting(name: str) -> float:
    source = (ROOT / "modelrelay_site" / "settings.py").read_text()
    match = re.search(rf'env_\w+\("{name}",\s*([\d.]+)', source)
    assert match, name
    return float(match.group(1))


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match, value
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def test_the_systemd_units_drain_on_sigterm_and_wait_long_enough():
    server = unit("modelrelay.service")["Service"]
    assert server["ExecStart"] == ["/opt/modelrelay/.venv/bin/python manage.py serve"]
    assert server["WorkingDirectory"] == ["/opt/modelrelay"]
    assert server["EnvironmentFile"] == ["/etc/modelrelay/modelrelay.env"]
    assert server["User"] == ["modelrelay"]
    assert server["KillSignal"] == ["SIGTERM"]
    assert seconds(server["TimeoutStopSec"][0]) > default_setting("SHUTDOWN_GRACE_SECS")
    assert server["Restart"] == ["on-failure"]
    assert server["NoNewPrivileges"] == ["yes"] and server["ProtectSystem"] == ["strict"]
    data_dir = env_example(SERVER_ENV)[0]["DATA_DIR"]
    assert server["ReadWritePaths"] == [data_dir]

    member = unit("modelrelay@.service")["Service"]  # one process of a cluster, per port
    assert member["ExecStart"] == [
        "/opt/modelrelay/.venv/bin/python manage.py serve --listen 127.0.0.1:%i"
    ]
    for setting in ("KillSignal", "TimeoutStopSec", "EnvironmentFile", "User", "Restart"):
        assert member[setting] == server[setting], setting

    worker = unit("modelrelay-worker@.service")["Service"]
    assert worker["ExecStart"] == ["/opt/modelrelay/.venv/bin/python worker.py"]
    assert worker["EnvironmentFile"] == ["/etc/modelrelay/worker-%i.env"]
    assert "WORKER_NAME=%i" in worker["Environment"][0].split()
    assert worker["KillSignal"] == ["SIGTERM"]
    assert seconds(worker["TimeoutStopSec"][0]) > default_setting("REQUEST_TIMEOUT_SECS")
    assert worker["Restart"] and worker["RestartSec"]


def test_systemd_accepts_the_units(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart exists: point it at this Python for the check.
    for name, target in (
        ("modelrelay.service", "modelrelay.service"),
        ("modelrelay@.service", "modelrelay@8081.service"),
        ("modelrelay-worker@.service", "modelrelay-worker@gpu-box-1.service"),
    ):
        text = (DEPLOY / name).read_text()
        (tmp_path / target).write_text(
            text.replace("/opt/modelrelay/.venv/bin/python", sys.executable)
        )
    result = subprocess.run(
        [
            analyze,
            "verify",
            "--man=no",
            "modelrelay.service",
            "modelrelay@8081.service",
            "modelrelay-worker@gpu-box-1.service",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- env examples


def env_example(path: Path) -> tuple[dict[str, str], set[str]]:
    """``(values of uncommented lines, every name mentioned as NAME= or #NAME=)``."""
    values: dict[str, str] = {}
    names: set[str] = set()
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"(#\s?)?([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            names.add(match.group(2))
            if not match.group(1):
                values[match.group(2)] = match.group(3)
    return values, names


def test_the_env_examples_document_every_setting_and_hold_no_secrets():
    settings_source = (ROOT / "modelrelay_site" / "settings.py").read_text()
    read = set(re.findall(r'env_(?:str|int|float|bool|list)\(\s*"([A-Z0-9_]+)"', settings_source))
    assert "WORKER_SECRET" in read
    values, documented = env_example(SERVER_ENV)
    assert read <= documented, f"settings missing from {SERVER_ENV.name}: {read - documented}"
    assert values["TRUSTED_PROXIES"] == "127.0.0.1"
    assert re.fullmatch(
        r"postgres://modelrelay:<[^>]+>@127\.0\.0\.1:5432/modelrelay", values["DATABASE_URL"]
    )

    if (ROOT / "worker.py").exists():
        help_text = subprocess.run(
            [sys.executable, "worker.py", "--help"],
            cwd=ROOT,
            env=os.environ | {"COLUMNS": "1000"},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        flags = set(re.findall(r"\benv\s+([A-Z][A-Z0-9_]+)", help_text))
        assert {"PROXY_URL", "WORKER_SECRET", "BACKEND_URL", "MODELS"} <= flags
        _, worker_documented = env_example(WORKER_ENV)
        assert flags <= worker_documented, (
            f"missing from {WORKER_ENV.name}: {flags - worker_documented}"
        )

    for path in (SERVER_ENV, WORKER_ENV):
        for key, value in env_example(path)[0].items():
            if SECRETISH.search(key):
                assert value == "" or re.fullmatch(r"<[^>]+>", value), (path.name, key)


#: Repository paths as docs/DEPLOY.md writes them (system paths such as /etc/... excluded).
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:deploy|scripts|docs|tests|relay)/[\w@.-]*\w|Dockerfile"
    r"|docker-compose\.yml|\.dockerignore|manage\.py|worker\.py|requirements(?:-worker)?\.txt)"
)


def test_the_deploy_guide_mentions_only_files_that_exist():
    mentioned = set(REPO_PATH.findall((ROOT / "docs" / "DEPLOY.md").read_text()))
    assert {"deploy/nginx.conf", "deploy/modelrelay-worker@.service", "Dockerfile"} <= mentioned
    assert sorted(m for m in mentioned if not (ROOT / m).exists()) == []
    # The worker's file list in the guide is the one the worker image copies.
    relay_files = {f for f in worker_stage_files() if f.startswith("relay/")}
    assert {m for m in mentioned if m.startswith("relay/")} == relay_files


# --------------------------------------------------------------------------- check --deploy


def test_the_production_env_example_passes_check_deploy(tmp_path):
    values, _ = env_example(SERVER_ENV)
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE",)}
    env |= values
    env |= {
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "DATA_DIR": str(tmp_path),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "REDIS_URL": "",
    }
    assert env["DEBUG"] == "false"
    assert env["ALLOWED_HOSTS"].startswith("relay.example.com")
    assert env["CSRF_TRUSTED_ORIGINS"] == "https://relay.example.com"
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
