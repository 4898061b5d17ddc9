"""The dashboard and the setup wizard in headless Chromium against a live server (SPEC §9).

One ``manage.py serve`` for the module, a staff user created in its database through
``manage.py createsuperuser``, Debian's Chromium driven by Playwright. Workers are
raw WebSocket clients (dashboard) and the real ``worker.pyz`` the wizard serves,
started with exactly the command the wizard shows, in front of a fake upstream.
Every wait is on a page condition with a bounded timeout. Screenshots go to
``test-artifacts/screenshots/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from relay.wire import protocol
from tests.conftest import IN_CI
from tests.live import ROOT, LiveServer, live_server
from tests.upstream import FakeUpstream

pytestmark = [pytest.mark.browser, pytest.mark.live]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOTS = ROOT / "test-artifacts" / "screenshots"
USERNAME, PASSWORD = "operator", "correct-horse-battery"
CHAT = "/v1/chat/completions"
WAIT_MS = 10_000


def require_chromium() -> None:
    if CHROMIUM.exists():
        return
    message = f"{CHROMIUM} is missing: run scripts/install-chromium.sh"
    if IN_CI:
        pytest.fail(message + " (CI requires the browser tests)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    require_chromium()
    with live_server(tmp_path_factory.mktemp("browser")) as live:
        create_operator(live)
        yield live


@pytest.fixture
def keyed_server(tmp_path: Path) -> Iterator[LiveServer]:
    """A server that requires API keys, with the operator and an admin token."""
    require_chromium()
    with live_server(
        tmp_path, MODELRELAY_REQUIRE_API_KEYS="true", MODELRELAY_ADMIN_TOKEN=ADMIN_TOKEN
    ) as live:
        create_operator(live)
        yield live


ADMIN_TOKEN = "browser-admin"


def create_operator(live: LiveServer) -> None:
    """The staff user the tests log in as."""
    env = {
        **live.env,
        "DJANGO_SUPERUSER_USERNAME": USERNAME,
        "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
        "DJANGO_SUPERUSER_EMAIL": "operator@example.com",
    }
    subprocess.run(
        [sys.executable, "manage.py", "createsuperuser", "--noinput"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield chromium
        finally:
            await chromium.close()


def shell_words(command: str) -> list[str]:
    """Split a shown command as sh does, line continuations included."""
    return shlex.split(command.replace("\\\n", " "))


async def new_page(browser: Any, **options: Any) -> Any:
    context = await browser.new_context(viewport={"width": 1280, "height": 860}, **options)
    context.set_default_timeout(WAIT_MS)
    return await context.new_page()


async def log_in(page: Any) -> None:
    """Fill in the admin login form the page was redirected to."""
    await page.wait_for_url("**/django-admin/login/**")
    await page.fill("#id_username", USERNAME)
    await page.fill("#id_password", PASSWORD)
    await page.click("input[type=submit]")


async def shoot(page: Any, name: str, **options: Any) -> None:
    await page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True, **options)


class RawWorker:
    """A worker speaking the wire protocol over a real socket; answers pings by itself.

    Requests are answered at once, except those for a model in ``hold``: they wait
    in ``held`` until the test answers them.
    """

    def __init__(self, ws: Any, hold: frozenset[str] = frozenset()) -> None:
        self.ws = ws
        self.hold = hold
        self.held: asyncio.Queue[protocol.Request] = asyncio.Queue()
        self.control: asyncio.Queue[Any] = asyncio.Queue()
        self.load = 0
        self.ack: protocol.RegisterAck | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def join(
        cls,
        server: LiveServer,
        name: str,
        models: list[str],
        *,
        max_concurrent: int = 1,
        hold: frozenset[str] = frozenset(),
    ) -> RawWorker:
        ws = await websockets.connect(
            server.ws_url + "?provider=local",
            additional_headers={"X-Worker-Secret": server.secret},
            max_size=None,
        )
        worker = cls(ws, hold)
        register = protocol.Register(
            worker_name=name, models=models, max_concurrent=max_concurrent, protocol_version="1"
        )
        await ws.send(protocol.encode(register))
        async with asyncio.timeout(5):
            ack = protocol.decode_server_message(await ws.recv())
        assert isinstance(ack, protocol.RegisterAck), ack
        worker.ack = ack
        worker._task = asyncio.create_task(worker._pump())
        return worker

    @property
    def id(self) -> str:
        assert self.ack is not None
        return self.ack.worker_id

    async def _pump(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for raw in self.ws:
                message = protocol.decode_server_message(raw)
                if isinstance(message, protocol.Ping):
                    await self.ws.send(protocol.encode(protocol.Pong(current_load=self.load)))
                elif isinstance(message, protocol.Request):
                    if message.model in self.hold:
                        self.load += 1
                        await self.held.put(message)
                    else:
                        await self.answer(message)
                else:
                    await self.control.put(message)

    async def answer(self, request: protocol.Request) -> None:
        body = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": request.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        }
        complete = protocol.ResponseComplete(
            request_id=request.request_id,
            status_code=200,
            headers={"content-type": "application/json"},
            body=json.dumps(body),
            token_counts=protocol.TokenCounts(prompt_tokens=12, completion_tokens=30),
        )
        await self.ws.send(protocol.encode(complete))

    async def expect(self, kind: type, timeout: float = 5.0) -> Any:
        async with asyncio.timeout(timeout):
            message = await self.control.get()
        assert isinstance(message, kind), message
        return message

    async def close(self) -> None:
        await self.ws.close()
        if self._task is not None:
            await self._task


@contextlib.contextmanager
def server_log_on_failure(server: LiveServer) -> Iterator[None]:
    """On failure, print what the server logged meanwhile (pytest shows it with the error)."""
    start = len(server.output)
    try:
        yield
    except BaseException:
        print("--- server log ---\n" + "".join(server.output[start:]))
        raise


async def test_the_dashboard_follows_workers_live_and_drains_them(server, browser):
    with server_log_on_failure(server):
        await _dashboard_flow(server, browser)


async def test_the_dashboard_shows_who_is_using_the_pool_live(keyed_server, browser):
    with server_log_on_failure(keyed_server):
        await _keys_flow(keyed_server, browser)


async def _keys_flow(server: LiveServer, browser: Any) -> None:
    from playwright.async_api import expect

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        team = (await client.post("/admin/keys", json={"name": "team-a"}, headers=admin)).json()
        lab = (
            await client.post(
                "/admin/keys",
                json={"name": "lab", "max_concurrent": 1, "tokens_per_day": 1000, "weight": 2},
                headers=admin,
            )
        ).json()
    page = await new_page(browser)
    await page.goto(server.url + "/dashboard")
    await log_in(page)
    await page.wait_for_url(server.url + "/dashboard")
    await expect(page.locator("#live-status")).to_have_attribute("data-state", "live")
    await expect(page.locator("#keys-empty")).to_be_visible()
    box = await RawWorker.join(server, "gpu-box", ["llama3-8b"], hold=frozenset({"llama3-8b"}))
    body = {"model": "llama3-8b", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:

            def post(key: dict[str, Any]) -> Any:
                auth = {"Authorization": f"Bearer {key['secret']}"}
                return asyncio.create_task(
                    client.post("/v1/chat/completions", json=body, headers=auth)
                )

            calls = [post(lab)]  # lab's reaches the worker first, then team's queue
            async with asyncio.timeout(5):
                first = await box.held.get()
            calls += [post(team), post(team)]
            refused = await client.post(
                "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {lab['secret']}"},
            )
            assert refused.status_code == 429
            lab_row = page.locator(f'#keys tr[data-key="{lab["id"]}"]')
            team_row = page.locator(f'#keys tr[data-key="{team["id"]}"]')
            await expect(lab_row.locator("[data-running]")).to_have_text("1")  # live
            await expect(team_row.locator("[data-queued]")).to_have_text("2")
            await expect(lab_row).to_contain_text("1 at once")
            await expect(lab_row.locator("td").nth(5)).to_have_text("1")  # refused
            await shoot(page, "dashboard-keys")
            await box.answer(first)
            for _ in range(2):
                async with asyncio.timeout(5):
                    await box.answer(await box.held.get())
            assert [(await call).status_code for call in calls] == [200, 200, 200]
            await expect(lab_row).to_contain_text("42 / 1,000")  # tokens today of budget
            await expect(team_row.locator("[data-queued]")).to_have_text("0")
            await expect(page.locator("#recent tbody tr").first).to_contain_text("team-a")
    finally:
        await box.close()
    await page.context.close()


async def test_the_dashboard_shows_a_batchs_progress_live(server, browser):
    with server_log_on_failure(server):
        await _batch_flow(server, browser)


async def _batch_flow(server: LiveServer, browser: Any) -> None:
    from playwright.async_api import expect

    page = await new_page(browser)
    await page.goto(server.url + "/dashboard")
    if "/django-admin/login/" in page.url:
        await log_in(page)
    await page.wait_for_url(server.url + "/dashboard")
    box = await RawWorker.join(server, "batch-box", ["batch-8b"], hold=frozenset({"batch-8b"}))
    lines = b"".join(
        json.dumps(
            {
                "custom_id": f"row-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "batch-8b", "messages": [{"role": "user", "content": "hi"}]},
            }
        ).encode()
        + b"\n"
        for i in range(3)
    )
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            files = {"file": ("rows.jsonl", lines, "application/jsonl")}
            uploaded = await client.post("/v1/files", files=files, data={"purpose": "batch"})
            body = {
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            }
            batch = (await client.post("/v1/batches", json=body)).json()
        row = page.locator(f'#batches tr[data-batch-id="{batch["id"]}"]')
        for done in range(3):
            async with asyncio.timeout(10):
                held = await box.held.get()
            await expect(row.locator("[data-done]")).to_have_text(f"{done} / 3")
            await expect(row).to_have_attribute("data-status", "in_progress")
            if done == 1:
                await shoot(page, "dashboard-batches")
            await box.answer(held)
            box.load -= 1
        await expect(row).to_have_attribute("data-status", "completed")
        await expect(row.locator("[data-done]")).to_have_text("3 / 3")
    finally:
        await box.close()
    await page.context.close()


async def test_the_wizard_walks_a_new_box_to_a_confirmed_live_worker(server, browser, tmp_path):
    with server_log_on_failure(server):
        await _wizard_flow(server, browser, tmp_path)


async def test_the_wizard_gives_a_box_two_commands_that_join_it(server, browser, tmp_path):
    with server_log_on_failure(server):
        await _join_flow(server, browser, tmp_path)


async def _dashboard_flow(server: LiveServer, browser: Any) -> None:
    from playwright.async_api import expect

    page = await new_page(browser)
    page.on("dialog", lambda dialog: dialog.accept())
    await page.goto(server.url + "/dashboard")
    await log_in(page)
    await page.wait_for_url(server.url + "/dashboard")
    await expect(page.locator("#live-status")).to_have_attribute("data-state", "live")
    await expect(page.locator("#empty-state")).to_be_visible()
    await expect(page.locator('#empty-state a[href="/setup"]')).to_be_visible()
    await shoot(page, "dashboard-empty")

    box1 = await RawWorker.join(
        server,
        "gpu-box-1",
        ["llama3-8b", "qwen2.5-7b-instruct"],
        max_concurrent=4,
        hold=frozenset({"qwen2.5-7b-instruct"}),
    )
    box2 = await RawWorker.join(server, "gpu-box-2", ["mistral-7b"], max_concurrent=2)
    try:
        row1 = page.locator(f'#workers tr[data-worker-id="{box1.id}"]')
        row2 = page.locator(f'#workers tr[data-worker-id="{box2.id}"]')
        await expect(row1).to_contain_text("gpu-box-1")  # appeared without a reload
        await expect(row1).to_contain_text("qwen2.5-7b-instruct")
        await expect(row2).to_contain_text("0 / 2")
        await expect(page.locator("#empty-state")).to_be_hidden()
        await expect(page.locator("#stat-workers")).to_have_text("2")

        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            for model in ("llama3-8b", "mistral-7b", "llama3-8b"):
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            missing = {"model": "no-such-model", "messages": []}
            assert (await client.post("/v1/chat/completions", json=missing)).status_code == 404
            held_call = asyncio.create_task(
                client.post("/v1/chat/completions", json={"model": "qwen2.5-7b-instruct"})
            )
            async with asyncio.timeout(5):
                held = await box1.held.get()
            await expect(page.locator("#recent tbody tr")).to_have_count(4)
            # Speeds learned from the request it answered (SPEC §21), shown live.
            await expect(row2.locator(".speed-cell")).to_contain_text("tok/s in")
            await expect(row2.locator(".speed-cell")).to_contain_text("measured")
            await expect(page.locator("#stat-inflight")).to_have_text("1")
            await expect(row1.locator(".load-text")).to_have_text("1 / 4")
            await shoot(page, "dashboard")
            await page.set_viewport_size({"width": 390, "height": 844})
            await page.wait_for_function(  # the chart is redrawn for the narrower screen
                "document.querySelector('#rate-chart svg').getAttribute('width') < 390"
            )
            await shoot(page, "dashboard-mobile")
            await page.set_viewport_size({"width": 1280, "height": 860})

            await row1.locator('button[data-action="drain"]').click()
            await box1.expect(protocol.GracefulShutdown)
            await expect(row1.locator('[data-state="draining"]')).to_have_text("Draining")
            await expect(row1.locator('button[data-action="drain"]')).to_be_disabled()
            await shoot(page, "dashboard-draining")

            await box1.answer(held)  # its last request done, the drained worker is closed
            assert (await held_call).status_code == 200
        await expect(row1).to_have_count(0)
        await expect(row2).to_be_visible()

        await row2.locator('button[data-action="refresh"]').click()
        await box2.expect(protocol.ModelsRefresh)
    finally:
        await box1.close()
        await box2.close()
    await expect(page.locator("#empty-state")).to_be_visible()
    await page.context.close()


async def _start_shown_worker(command: str, tmp: Path) -> asyncio.subprocess.Process:
    """Run the wizard's run command in ``tmp``, with this interpreter as the venv's python."""
    argv = shell_words(command)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "WORKER_NAME": "wizard-box"}
    while "=" in argv[0]:  # the command's own environment (sh: NAME=value command ...)
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    assert argv[:2] == ["modelrelay-worker/bin/python", "worker.pyz"], argv
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *argv[1:],
        cwd=tmp,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


async def _stop(process: asyncio.subprocess.Process) -> tuple[int | None, str]:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(10):
            output, _ = await process.communicate()
    except TimeoutError:
        process.kill()
        output, _ = await process.communicate()
    return process.returncode, output.decode(errors="replace")


async def _wizard_flow(server: LiveServer, browser: Any, tmp_path: Path) -> None:
    from playwright.async_api import expect

    page = await new_page(browser)
    await page.goto(server.url + "/setup")
    await page.locator('label.choice:has(input[value="linux"])').click()
    await page.locator('label.choice:has(input[value="llama"])').click()
    await shoot(page, "setup-1-platform")
    await page.click("#next")

    await page.wait_for_url("**/setup/backend?platform=linux&backend=llama")
    await expect(page.locator("#backend-steps")).to_contain_text(
        "llama-server -m model.gguf --port 8000 -np 4"
    )
    await shoot(page, "setup-2-backend")
    await page.click("#next")

    await log_in(page)  # step 3 needs staff; the login brings us back to it
    await page.wait_for_url("**/setup/worker?platform=linux&backend=llama")
    async with FakeUpstream(models=["tiny-llama"]) as upstream:
        await page.locator('label.choice:has(input[value="new"])').click()
        await page.fill("#id_name", "lab-gpus")
        await page.fill("#id_backend_url", upstream.url)
        await shoot(page, "setup-3-form")
        await page.click("#create-secret")

        secret = (await page.locator("#worker-secret").inner_text()).strip()
        assert secret.startswith("mrw_")
        script = await page.locator("#install-command-linux").inner_text()
        run = await page.locator("#run-command-linux").inner_text()
        assert f"curl -fsSLO {server.url}/setup/worker.pyz" in script
        argv = shell_words(run)
        assert argv[0] == f"WORKER_SECRET={secret}"  # in the environment, not in `ps`
        assert argv[argv.index("--proxy-url") + 1] == server.url
        assert argv[argv.index("--provider") + 1] == "lab-gpus"
        assert "--worker-secret" not in argv
        assert "--models" not in argv  # left empty: the worker asks the backend
        await expect(page.locator("#waiting")).to_be_visible()
        await shoot(page, "setup-3-command")

        async with httpx.AsyncClient(timeout=10) as client:  # what the shown curl -O does
            response = await client.get(f"{server.url}/setup/worker.pyz")
            (tmp_path / "worker.pyz").write_bytes(response.content)
        worker = await _start_shown_worker(run, tmp_path)
        try:
            await expect(page.locator("#ready")).to_be_visible(timeout=20_000)
            await expect(page.locator("#ready-workers")).to_contain_text("wizard-box")
            await expect(page.locator("#ready-workers")).to_contain_text("tiny-llama")
            curl = await page.locator("#curl-test").inner_text()
            await shoot(page, "setup-4-ready")
            await page.set_viewport_size({"width": 390, "height": 844})
            await shoot(page, "setup-4-ready-mobile")

            answer = await _send_like_curl(curl, server.url)
            assert answer["model"] == "tiny-llama" and answer["choices"]
        finally:
            code, log = await _stop(worker)
        assert code == 0, log
    await page.context.close()


async def _send_like_curl(snippet: str, base_url: str) -> Any:
    """Paste the shown curl test into a shell (or, without curl, send its URL and body)."""
    argv = shell_words(snippet)
    assert argv[0] == "curl" and argv[1] == f"{base_url}/v1/chat/completions", argv
    if shutil.which("curl") and shutil.which("sh"):
        process = await asyncio.create_subprocess_exec(
            "sh", "-c", snippet + " --silent --show-error", stdout=asyncio.subprocess.PIPE
        )
        async with asyncio.timeout(15):
            output, _ = await process.communicate()
        assert process.returncode == 0
        return json.loads(output)
    async with httpx.AsyncClient(timeout=15) as client:
        body = argv[argv.index("-d") + 1]
        headers = {"Content-Type": "application/json"}
        response = await client.post(argv[1], content=body, headers=headers)
        return response.json()


async def _join_flow(server: LiveServer, browser: Any, tmp_path: Path) -> None:
    """Join with a token (SPEC §22): the two commands the page shows, pasted into a shell
    on a box with a backend on a port discovery is told of, confirm the worker."""
    from playwright.async_api import expect

    from relay.pages.wheel import wheel_filename

    page = await new_page(browser)
    await page.goto(server.url + "/setup/worker?platform=linux&backend=llama")
    await log_in(page)
    await page.wait_for_url("**/setup/worker?platform=linux&backend=llama")
    await expect(page.locator('input[name="mode"][value="join"]')).to_be_checked()
    await expect(page.locator("#id_provider")).to_be_visible()
    await expect(page.locator("#id_name")).to_be_hidden()
    await expect(page.locator("#id_backend_url")).to_have_value("")
    await shoot(page, "setup-join-form")
    await page.click("#create-secret")

    token = (await page.locator("#join-token").inner_text()).strip()
    assert token.startswith("mrj_")
    install = (await page.locator("#join-install-linux").inner_text()).strip()
    run = (await page.locator("#join-run-linux").inner_text()).strip()
    wheel_url = f"{server.url}/setup/{wheel_filename()}"
    assert (
        install
        == f"python3 -m venv modelrelay-worker && modelrelay-worker/bin/pip install {wheel_url}"
    )
    assert shell_words(run) == [
        "modelrelay-worker/bin/modelrelay-worker",
        "--proxy-url",
        server.url,
        "--join-token",
        token,
    ]
    await expect(page.locator("#waiting")).to_be_visible()
    await shoot(page, "setup-join-commands")

    # A shell on the box: python3 is this interpreter (a fresh venv is made from it).
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "python3").symlink_to(sys.executable)
    env = {
        "PATH": f"{tools}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp_path),
        "WORKER_NAME": "joined-box",
    }
    for name in ("PIP_FIND_LINKS", "PIP_CERT", "PIP_DEFAULT_TIMEOUT"):
        if name in os.environ:
            env[name] = os.environ[name]
    installing = await asyncio.create_subprocess_exec(
        "sh",
        "-c",
        install,
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(300):
        output, _ = await installing.communicate()
    assert installing.returncode == 0, output.decode(errors="replace")

    async with FakeUpstream(models=["joined-llama"]) as upstream:
        env["MODELRELAY_PROBE_PORTS"] = upstream.url.rsplit(":", 1)[1]
        worker = await asyncio.create_subprocess_exec(
            "sh",
            "-c",
            "exec " + run,  # the signals of _stop reach the worker, not only sh
            cwd=tmp_path,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            await expect(page.locator("#ready")).to_be_visible(timeout=30_000)
            await expect(page.locator("#ready-workers")).to_contain_text("joined-box")
            await expect(page.locator("#ready-workers")).to_contain_text("joined-llama")
            await shoot(page, "setup-join-ready")
            answer = await _send_like_curl(
                await page.locator("#curl-test").inner_text(), server.url
            )
            assert answer["model"] == "joined-llama" and answer["choices"]
        finally:
            code, log = await _stop(worker)
        assert code == 0, log
        assert (
            "backend: using an OpenAI-compatible server" in log and "the join token is spent" in log
        )
    saved = tmp_path / ".config" / "modelrelay-worker" / "credential.json"
    assert saved.stat().st_mode & 0o777 == 0o600
    await page.context.close()


async def test_at_1400_px_the_dashboard_and_the_admin_lists_show_every_status_column(
    server, browser
):
    with server_log_on_failure(server):
        await _wide_flow(server, browser)


#: A laptop's browser window: every list must fit it without hiding a status column.
WIDE = {"width": 1400, "height": 900}


async def fits(page: Any, selector: str) -> None:
    """Every element ``selector`` matches lies inside the viewport, whole, and nothing
    around it scrolls sideways (no scroller holds part of it out of sight)."""
    found = await page.eval_on_selector_all(
        selector,
        """(nodes) => nodes.map((node) => {
            const box = node.getBoundingClientRect();
            let clipped = null;  // the scroller that hides part of it, if any
            for (let up = node.parentElement; up; up = up.parentElement) {
                const scrolls = getComputedStyle(up).overflowX !== "visible";
                if (scrolls && up.scrollWidth > up.clientWidth + 1) {
                    clipped = `${up.tagName}.${up.className} ${up.scrollWidth}>${up.clientWidth}`;
                }
            }
            return {left: box.left, right: box.right, width: box.width, clipped: clipped,
                    cut: node.scrollWidth > node.clientWidth + 1};
        })""",
    )
    assert found, f"nothing matches {selector}"
    width = page.viewport_size["width"]
    for box in found:
        assert box["width"] > 0 and box["left"] >= 0 and box["right"] <= width, (selector, box)
        assert not box["clipped"] and not box["cut"], (selector, box)


async def _wide_flow(server: LiveServer, browser: Any) -> None:
    from playwright.async_api import expect

    page = await new_page(browser)
    await page.set_viewport_size(WIDE)
    await page.goto(server.url + "/dashboard")
    if "/django-admin/login/" in page.url:
        await log_in(page)
    await page.wait_for_url(server.url + "/dashboard")
    box = await RawWorker.join(
        server, "wide-box", ["wide-8b", "slow-8b"], max_concurrent=4, hold=frozenset({"slow-8b"})
    )

    def chat(model: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}]}

    def line(i: int, anthropic: bool) -> dict[str, Any]:
        if anthropic:
            return {"custom_id": f"a-{i}", "params": {**chat("wide-8b"), "max_tokens": 8}}
        return {"custom_id": f"o-{i}", "method": "POST", "url": CHAT, "body": chat("wide-8b")}

    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            # The first to arrive ends last: it is held until the second has ended.
            slow = asyncio.create_task(client.post(CHAT, json=chat("slow-8b")))
            async with asyncio.timeout(5):
                held = await box.held.get()
            assert (await client.post(CHAT, json=chat("wide-8b"))).status_code == 200
            await box.answer(held)
            box.load -= 1
            assert (await slow).status_code == 200
            assert (await client.post(CHAT, json=chat("nobody-8b"))).status_code == 404
            rows = b"".join(json.dumps(line(i, False)).encode() + b"\n" for i in range(2))
            files = {"file": ("rows.jsonl", rows, "application/jsonl")}
            uploaded = (
                await client.post("/v1/files", files=files, data={"purpose": "batch"})
            ).json()
            openai_batch = (
                await client.post(
                    "/v1/batches",
                    json={
                        "input_file_id": uploaded["id"],
                        "endpoint": CHAT,
                        "completion_window": "24h",
                    },
                )
            ).json()
            anthropic_batch = (
                await client.post(
                    "/v1/messages/batches",
                    json={"requests": [line(i, True) for i in range(2)]},
                    headers={"anthropic-version": "2023-06-01"},
                )
            ).json()
        # Batch lines run as flex, and the recent list says so.
        flex = page.locator('#recent tr td[data-class="flex"]')
        await expect(flex.first).to_have_text("flex")
        ended = page.locator(f'#batches tr[data-batch-id="{anthropic_batch["id"]}"]')
        await expect(ended).to_have_attribute("data-api-status", "ended")
        await expect(ended.locator(".badge")).to_have_text("ended")
        done = page.locator(f'#batches tr[data-batch-id="{openai_batch["id"]}"]')
        await expect(done.locator(".badge")).to_have_text("completed")
        # Latest ended first, whatever the order they arrived in.
        ends = [
            float(at)
            for at in await page.eval_on_selector_all(
                "#recent tbody tr", "(rows) => rows.map((row) => row.dataset.endedAt)"
            )
        ]
        assert len(ends) >= 6 and ends == sorted(ends, reverse=True), ends
        classes = await page.eval_on_selector_all(
            "#recent tbody tr td[data-class]", "(cells) => cells.map((c) => c.dataset.class)"
        )
        assert set(classes) == {"default", "flex"}, classes
        await shoot(page, "dashboard-1400")
        await fits(page, "#recent thead th")
        await fits(page, "#recent tbody td .badge[class*=status-]")
        await fits(page, "#batches thead th")
        await fits(page, ".stat-sub")  # the prompt cache card's line included

        # The admin's lists, once the request log has been written (in batches).
        log = server.url + "/django-admin/workers_app/requestlog/?q=wide-box"
        for _ in range(100):
            await page.goto(log)
            if await page.locator("#result_list td.field-priority_class").count() >= 6:
                break
            await asyncio.sleep(0.1)  # a bounded poll: the rows are written every second
        else:
            raise AssertionError("the request log rows were not written")
        await shoot(page, "admin-requestlog-1400")
        await fits(page, "#result_list thead th")
        await fits(page, "#result_list td.field-status")
        await fits(page, "#result_list td.field-outcome")
        await page.goto(server.url + "/django-admin/batches/batch/")
        row = page.locator("#result_list tbody tr", has_text=anthropic_batch["id"])
        await expect(row.locator("td.field-api_status")).to_have_text("ended")
        await shoot(page, "admin-batches-1400")
        await fits(page, "#result_list thead th")
        await fits(page, "#result_list td.field-api_status")
    finally:
        await box.close()
    await page.context.close()


async def test_the_dashboard_shows_each_models_state_as_the_relay_loads_it(server, browser):
    from playwright.async_api import expect

    from relay.wire.protocol import LOADABLE, LOADED
    from tests.statesworker import StatesWorker

    with server_log_on_failure(server):
        page = await new_page(browser)
        await page.goto(server.url + "/dashboard")
        await log_in(page)
        await page.wait_for_url(server.url + "/dashboard")
        states = {"on-demand-a": LOADED, "on-demand-b": LOADABLE}
        async with StatesWorker(server, states, capacity=1, name="router-box") as box:
            a = page.locator('#workers [data-model-state]:has-text("on-demand-a")')
            b = page.locator('#workers [data-model-state]:has-text("on-demand-b")')
            await expect(a).to_have_attribute("data-model-state", LOADED)
            await expect(b).to_have_attribute("data-model-state", LOADABLE)
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                body = {"model": "on-demand-b", "messages": []}
                assert (await client.post(CHAT, json=body)).status_code == 200
            # The relay unloaded the idle model to load the one asked for: both live.
            await expect(b).to_have_attribute("data-model-state", LOADED)
            await expect(a).to_have_attribute("data-model-state", LOADABLE)
            await expect(b).to_have_attribute("title", re.compile(r"1 loads"))
            assert box.ops == [("unload", "on-demand-a"), ("load", "on-demand-b")]
            await shoot(page, "dashboard-models-on-demand")
