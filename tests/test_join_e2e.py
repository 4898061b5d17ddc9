"""A GPU box joins in one command (SPEC §22), end to end with real processes.

A live relay (``manage.py serve``), the worker installed from the wheel the relay
serves into a fresh virtual environment and started as ``modelrelay-worker`` with
nothing but ``--proxy-url`` and ``--join-token`` (discovery finds the backend on a free
port named by ``MODELRELAY_PROBE_PORTS``), a fake backend or the real llama-server.
Revoking one of three connected workers closes it within a heartbeat interval while
the other two serve every request.

The fresh environment is made without pip (the suite's pip installs into it), which
keeps the test near 15 s; the measured run with llama-server does exactly what a person
does (``python -m venv``, its own ``pip install``) and is marked ``slow``: ``make test``
runs it once, skipped with the reason where llama-server was not built (``make
llama-server``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from relay.pages.wheel import wheel_filename
from tests.live import ROOT, LiveServer
from tests.upstream import upstream_in_thread

pytestmark = pytest.mark.live

ADMIN_TOKEN = "join-e2e-admin"
LLAMA = ROOT / ".bench-cache" / "llama-server"


class Process:
    """A process whose stderr and stdout lines the test can wait for."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path = ROOT) -> None:
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_log(self, needle: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if needle in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{needle!r} not in the log:\n{self.log}")
                self._changed.wait(min(left, 0.5))

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(timeout=5)
        return code


@contextmanager
def running(argv: list[str], env: dict[str, str], cwd: Path = ROOT) -> Iterator[Process]:
    process = Process(argv, env, cwd)
    try:
        yield process
    finally:
        process.stop()


def mint(server: LiveServer, uses: int = 1) -> str:
    """A join token, as an operator mints it with manage.py."""
    result = subprocess.run(
        [sys.executable, "manage.py", "create_join_token", "--provider=local", f"--uses={uses}"],
        cwd=ROOT,
        env=server.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.strip().splitlines()[-1]


def box_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a shell on a GPU box: no WORKER_* settings, its own home."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}
    for name in ("PIP_CONFIG_FILE", "PIP_FIND_LINKS", "PIP_CERT", "PIP_DEFAULT_TIMEOUT"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env | extra


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def served_models(server: LiveServer) -> list[str]:
    return [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=5).json()["data"]]


def chat(server: LiveServer, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- a fresh venv, the wheel, two flags -------------------------------------------------------


def test_a_fresh_venv_installs_the_wheel_and_joins_with_two_flags(relay_server, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    wheel_url = f"{relay_server.url}/setup/{wheel_filename()}"
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    install = subprocess.run(
        [*pip, "install", "--disable-pip-version-check", "--quiet", wheel_url],
        env=box_env(home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    # Only the worker's dependencies: no Django, no server code.
    check = (
        "import importlib.util as u, relay;"
        "assert u.find_spec('django') is None and u.find_spec('relay.server') is None;"
        "print(relay.__file__)"
    )
    found = subprocess.run(  # not from the checkout: the venv's own
        [venv / "bin" / "python", "-c", check],
        cwd=home,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 0 and str(venv) in found.stdout, found.stderr

    with upstream_in_thread(models=["tiny-model"]) as backend:
        port = backend.url.rsplit(":", 1)[1]
        env = box_env(home, MODELRELAY_PROBE_PORTS=port)
        command = [venv / "bin" / "modelrelay-worker", "--proxy-url", relay_server.url]
        token = mint(relay_server)
        with running([*map(str, command), "--join-token", token], env, tmp_path) as worker:
            worker.wait_log(f"backend: using an OpenAI-compatible server at {backend.url}")
            worker.wait_log("the join token is spent")
            wait_for(lambda: served_models(relay_server) == ["tiny-model"], 20, "the model")
            answer = chat(relay_server, "tiny-model")
            assert answer.status_code == 200 and answer.json()["choices"]
            # A copy of the box (its state directory too) is refused while this one is
            # connected, and asks again with the usual backoff: a hold left by a relay
            # process that died lapses by itself.
            with running([*map(str, command)], env, tmp_path) as copy:
                copy.wait_log("is connected already); reconnecting in")
            assert "the proxy refused this worker" not in copy.log
            assert chat(relay_server, "tiny-model").status_code == 200
        assert worker.proc.returncode == 0, worker.log
        saved = home / ".config" / "modelrelay-worker" / "credential.json"
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        assert stat.S_IMODE(saved.parent.stat().st_mode) == 0o700
        assert json.loads(saved.read_text())["credential"] not in worker.log

        # The same command again (a reboot, the shell history): the saved credential.
        with running([*map(str, command), "--join-token", token], env, tmp_path) as again:
            again.wait_log("with the credential in")
            again.wait_log("registered as worker")
            assert chat(relay_server, "tiny-model").status_code == 200
        # python -m relay.worker is the same program.
        help_text = subprocess.run(
            [venv / "bin" / "python", "-m", "relay.worker", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "--join-token" in help_text and "--state-dir" in help_text


# -- revoking one of three ----------------------------------------------------------------------


def test_revoking_one_of_three_workers_closes_it_within_a_heartbeat_and_the_others_serve_on(
    relay_server_factory, tmp_path
):
    with (
        relay_server_factory(MODELRELAY_ADMIN_TOKEN=ADMIN_TOKEN) as server,
        upstream_in_thread(models=["tiny-model"]) as backend,
    ):
        heartbeat = float(server.env.get("HEARTBEAT_INTERVAL_SECS", "15"))
        token = mint(server, uses=3)
        workers = []
        try:
            for index in range(3):
                state = tmp_path / f"box-{index}"
                argv = [sys.executable, "worker.py", "--proxy-url", server.url]
                argv += ["--join-token", token, "--state-dir", str(state)]
                argv += ["--worker-name", f"box-{index}", "--backend-url", backend.url]
                workers.append(Process(argv, box_env(tmp_path, PYTHONUNBUFFERED="1")))
            for worker in workers:
                worker.wait_log("registered as worker")
            admin = httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
            )
            joined = {w["name"]: w for w in admin.get("/admin/joined-workers").json()}
            assert sorted(joined) == ["box-0", "box-1", "box-2"]

            statuses: list[int] = []
            stop = threading.Event()

            def traffic() -> None:
                with httpx.Client(base_url=server.url, timeout=30) as client:
                    body = {"model": "tiny-model", "messages": [{"role": "user", "content": "x"}]}
                    for _ in range(2000):  # bounded: a few seconds of requests
                        if stop.is_set():
                            return
                        statuses.append(client.post("/v1/chat/completions", json=body).status_code)

            clients = [threading.Thread(target=traffic) for _ in range(4)]
            for thread in clients:
                thread.start()
            wait_for(lambda: len(statuses) >= 40, 30, "traffic")
            started = time.monotonic()
            assert admin.delete(f"/admin/joined-workers/{joined['box-1']['id']}").status_code == 204

            def gone() -> bool:
                names = [w["name"] for w in admin.get("/admin/workers").json()]
                return "box-1" not in names

            wait_for(gone, heartbeat, "the revoked worker to be gone")
            revoked_after = time.monotonic() - started
            seen = len(statuses)
            wait_for(lambda: len(statuses) >= seen + 40, 30, "traffic after the revocation")
            stop.set()
            for thread in clients:
                thread.join(timeout=30)
            names = sorted(w["name"] for w in admin.get("/admin/workers").json())
            assert names == ["box-0", "box-2"]
            assert set(statuses) == {200}, sorted(set(statuses))
            workers[1].wait_log("worker credential revoked")
            print(  # the figure docs/WORKER.md quotes
                f"\nrevoked box-1 of 3: gone from /admin/workers after {revoked_after:.3f}s "
                f"(heartbeat interval {heartbeat:g}s); {len(statuses)} requests, all 200"
            )
        finally:
            for worker in workers:
                worker.stop()


# -- measured: pip install, one command, the first request through llama-server ---------------


@pytest.mark.slow
def test_measured_pip_install_then_one_command_to_the_first_request_through_llama_server(
    relay_server, tmp_path
):
    binary, model = LLAMA / "bin" / "llama-server", LLAMA / "tiny.gguf"
    if not (binary.exists() and model.exists()):
        pytest.skip(f"{binary} is not built (make llama-server)")
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    llama_argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    llama_argv += ["-np", "2", "-c", "1024", "-t", "2", "--alias", "tiny"]
    with running(llama_argv, box_env(home)) as llama:
        wait_for(lambda: _healthy(port), 60, "llama-server to load its model")
        token = mint(relay_server)
        venv = tmp_path / "modelrelay-worker"
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
        made = time.monotonic()
        wheel_url = f"{relay_server.url}/setup/{wheel_filename()}"
        install = subprocess.run(
            [venv / "bin" / "pip", "install", "--disable-pip-version-check", "-q", wheel_url],
            env=box_env(home),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert install.returncode == 0, install.stdout + install.stderr
        installed = time.monotonic()
        env = box_env(home, MODELRELAY_PROBE_PORTS=f"{free_port()},{port}")
        command = [str(venv / "bin" / "modelrelay-worker"), "--proxy-url", relay_server.url]
        with running([*command, "--join-token", token], env, tmp_path) as worker:
            worker.wait_log(f"backend: using llama-server at http://127.0.0.1:{port}", 30)
            wait_for(lambda: "tiny" in served_models(relay_server), 30, "the model")
            answer = chat(relay_server, "tiny", max_tokens=8)
            served = time.monotonic()
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]
        print(
            f"\nfresh venv {made - started:.1f}s, pip install of the wheel "
            f"{installed - made:.1f}s, one command to the first request served "
            f"{served - installed:.1f}s: {served - made:.1f}s after the venv "
            f"({served - started:.1f}s with it)"
        )
        assert served - made < 60, worker.log
        assert llama.proc.poll() is None


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
