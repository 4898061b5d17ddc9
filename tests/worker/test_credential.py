"""The worker's own credential (SPEC §22): the join exchange against a fake relay, the
file it is kept in (0600 in a 0700 directory), and which credential a start uses."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from pathlib import Path

import pytest

from relay.wire import joining
from relay.worker import credential
from relay.worker.config import parse_config

TOKEN = "mrj_" + "t" * 43
NEW_TOKEN = "mrj_" + "n" * 43
CREDENTIAL = "mrc_" + "c" * 43


class FakeRelay:
    """Answers ``POST /v1/worker/join`` with the scripted (status, headers, body) in turn."""

    def __init__(self, *answers: tuple[int, dict[str, str], bytes]) -> None:
        self.answers = list(answers)
        self.requests: list[dict] = []
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> FakeRelay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = int(
            next(
                h.split(":")[1]
                for h in head.split("\r\n")
                if h.lower().startswith("content-length")
            )
        )
        body = await reader.readexactly(length)
        assert head.startswith(f"POST {joining.PATH} ")
        self.requests.append(json.loads(body))
        status, headers, answer = self.answers.pop(0)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n{extra}"
            f"content-length: {len(answer)}\r\nconnection: close\r\n\r\n".encode()
            + answer
        )
        await writer.drain()
        writer.close()


def welcome(worker_id: int = 7, provider: str = "lab") -> tuple[int, dict[str, str], bytes]:
    answer = {"worker_id": worker_id, "name": "box", "provider": provider, "credential": CREDENTIAL}
    return 201, {}, json.dumps(answer).encode()


def refusal(status: int, message: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": "join_refused"}}
    return status, headers, json.dumps(body).encode()


def config(proxy: str, state: Path, *extra: str, **env: str):
    argv = ["--proxy-url", proxy, "--state-dir", str(state), "--worker-name", "box", *extra]
    argv += ["--backoff-min-secs", "0.01", "--backoff-max-secs", "0.02"]
    return parse_config(argv, env=env)


async def no_sleep(delay: float) -> None:
    no_sleep.waits.append(delay)  # type: ignore[attr-defined]


no_sleep.waits = []  # type: ignore[attr-defined]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_a_join_saves_a_private_credential_and_connects_with_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, "modelrelay.worker")
    state = tmp_path / "state"
    async with FakeRelay(welcome()) as relay:
        settled = await credential.settle(config(relay.url, state, "--join-token", TOKEN))
    assert relay.requests == [{"token": TOKEN, "name": "box"}]
    assert settled.credential == CREDENTIAL and settled.provider == "lab"
    assert settled.auth_headers == {"X-Worker-Credential": CREDENTIAL}
    saved = state / "credential.json"
    assert mode(saved) == 0o600 and mode(state) == 0o700
    document = json.loads(saved.read_text())
    assert document["credential"] == CREDENTIAL and document["worker_id"] == 7
    assert document["token"] == TOKEN[:12]  # not enough to join with
    assert TOKEN not in saved.read_text()
    assert sorted(p.name for p in state.iterdir()) == ["credential.json"]  # no leftovers
    assert "the join token is spent" in caplog.text and CREDENTIAL not in caplog.text


async def test_a_looser_state_directory_is_narrowed_to_its_owner(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    async with FakeRelay(welcome()) as relay:
        await credential.settle(config(relay.url, state, "--join-token", TOKEN))
    assert mode(state) == 0o700


async def test_the_same_command_run_again_uses_the_saved_credential(tmp_path):
    state = tmp_path / "state"
    async with FakeRelay(welcome()) as relay:
        await credential.settle(config(relay.url, state, "--join-token", TOKEN))
        again = await credential.settle(config(relay.url, state, "--join-token", TOKEN))
        bare = await credential.settle(config(relay.url + "/", state))  # no token, no secret
        secret = await credential.settle(config(relay.url, state, "--worker-secret", "mrw_x"))
    assert len(relay.requests) == 1  # the spent token was never sent again
    for settled in (again, bare, secret):
        assert settled.credential == CREDENTIAL and settled.worker_secret == ""


async def test_a_new_token_joins_again_and_replaces_the_credential(tmp_path):
    state = tmp_path / "state"
    async with FakeRelay(welcome(7), welcome(8)) as relay:
        await credential.settle(config(relay.url, state, "--join-token", TOKEN))
        await credential.settle(config(relay.url, state, "--join-token", NEW_TOKEN))
    assert [r["token"] for r in relay.requests] == [TOKEN, NEW_TOKEN]
    assert json.loads((state / "credential.json").read_text())["worker_id"] == 8


async def test_a_credential_for_another_relay_is_not_used(tmp_path):
    state = tmp_path / "state"
    async with FakeRelay(welcome()) as relay:
        await credential.settle(config(relay.url, state, "--join-token", TOKEN))
    other = config("https://other.example.com", state, "--worker-secret", "mrw_x")
    settled = await credential.settle(other)
    assert settled.credential == "" and settled.auth_headers == {"X-Worker-Secret": "mrw_x"}
    with pytest.raises(credential.JoinRefused, match="no credential for"):
        await credential.settle(config("https://other.example.com", state))


async def test_the_provider_secret_is_used_when_the_worker_never_joined(tmp_path):
    settled = await credential.settle(
        config("http://127.0.0.1:9", tmp_path, "--worker-secret", "mrw_s")
    )
    assert settled.credential == "" and settled.auth_headers == {"X-Worker-Secret": "mrw_s"}


def test_without_a_token_a_secret_or_a_saved_credential_it_refuses_to_start(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        config("http://127.0.0.1:9", tmp_path / "empty")
    assert exited.value.code == 2
    assert "needs a join token" in capsys.readouterr().err


async def test_a_refused_token_stops_the_worker_with_the_relays_reason(tmp_path):
    async with FakeRelay(refusal(401, "join token already used")) as relay:
        with pytest.raises(credential.JoinRefused, match="join token already used"):
            await credential.settle(config(relay.url, tmp_path / "s", "--join-token", TOKEN))
    assert not (tmp_path / "s" / "credential.json").exists()
    assert list((tmp_path / "s").iterdir()) == []  # the pending file is gone


async def test_an_unreachable_or_failing_or_throttling_relay_is_asked_again(tmp_path):
    no_sleep.waits.clear()  # type: ignore[attr-defined]
    async with FakeRelay(
        refusal(503, "server restarting"),
        refusal(429, "too many failed attempts", **{"retry-after": "7"}),
        welcome(),
    ) as relay:
        saved = await credential.join(
            config(relay.url, tmp_path / "s", "--join-token", TOKEN), sleep=no_sleep
        )
    assert saved.credential == CREDENTIAL
    waits = no_sleep.waits  # type: ignore[attr-defined]
    assert len(waits) == 2 and waits[1] == 7.0  # the relay's Retry-After


async def test_a_state_directory_that_cannot_be_written_fails_before_the_token_is_spent(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    async with FakeRelay(welcome()) as relay:
        with pytest.raises(credential.JoinRefused, match="the join token was not used"):
            await credential.settle(config(relay.url, blocker / "state", "--join-token", TOKEN))
    assert relay.requests == []


@pytest.mark.parametrize(
    "content",
    [b"not json", b'{"credential": "mrw_not-a-credential"}', b"[1]", b"{" + b" " * 70_000 + b"}"],
)
def test_an_unusable_credential_file_is_ignored_and_said(tmp_path, content, caplog):
    (tmp_path / "credential.json").write_bytes(content)
    assert credential.load(str(tmp_path)) is None
    assert "ignoring the saved credential" in caplog.text


def test_a_join_token_flag_is_checked():
    for bad in ("mrw_looks-like-a-secret", "mrj_short", "mrj_" + "x" * 200):
        with pytest.raises(SystemExit):
            parse_config(["--join-token", bad], env={})
