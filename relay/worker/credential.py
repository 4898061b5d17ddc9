"""This worker's own credential (SPEC §22): traded for a join token, kept in a file.

Called once at start-up (:func:`settle`), after backend discovery and before the worker
connects:

- a credential saved in ``--state-dir`` for this relay is used, and a join token given
  again with it (the same command run twice) is ignored;
- otherwise a join token is traded at ``POST /v1/worker/join`` (:mod:`relay.wire.joining`)
  for a credential, which is written to ``<state-dir>/credential.json`` (mode 0600, in
  a directory of mode 0700) before it is used; the token is then spent. A token other
  than the one the saved credential came from joins again, as a new worker;
- otherwise the provider's shared secret is used, as before joining existed.

The file is written where it will stay before the token is spent (a state directory
that cannot be written fails first, with the token intact) and replaced atomically.
A relay that cannot be reached, or answers 5xx, is asked again with backoff; one that
refuses the token says why, and the worker stops with status 2 (:class:`JoinRefused`):
a spent or expired token never works again. Imports nothing from Django.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import ssl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from relay import __version__
from relay.wire import joining
from relay.worker.config import CREDENTIAL_FILE as FILE
from relay.worker.config import Config

log = logging.getLogger("modelrelay.worker")

#: The largest credential file read (it holds a few short strings).
MAX_FILE_BYTES = 64 * 1024
#: How long one join request may take.
JOIN_TIMEOUT_SECS = 30.0
#: The longest wait a relay's Retry-After may impose between two attempts.
MAX_RETRY_AFTER_SECS = 900.0
#: The lookup prefix of a join token: kept in the file, to tell a new token from the
#: one the saved credential came from (it is not enough to join with).
TOKEN_PREFIX_LEN = 12


#: How the relay refuses a credential whose identity another connection holds. That hold
#: lapses by itself when the relay process holding it died (WORKER_LEASE_SECS), so the
#: worker asks again with its usual backoff, not the slow retry of a refusal.
HELD_ELSEWHERE = "is connected already"


def held_elsewhere(reason: str) -> bool:
    """Whether a close reason is the relay's "another connection holds this identity"."""
    return HELD_ELSEWHERE in reason


class JoinRefused(Exception):
    """The relay refused the join token (spent, expired, revoked, unknown), or the
    credential cannot be kept; retrying with the same settings cannot help."""


@dataclass(frozen=True)
class Saved:
    """What the credential file holds."""

    proxy_url: str
    provider: str
    worker_id: int
    name: str
    credential: str
    #: The lookup prefix of the join token it was traded for.
    token: str
    joined_at: str


def saved_path(state_dir: str) -> Path:
    return Path(state_dir) / FILE


def relay_identity(proxy_url: str) -> str:
    """A relay URL as the credential file compares it: ``ws``/``wss`` as ``http``/``https``,
    lower-case scheme and host, no trailing slash."""
    parts = urlsplit(proxy_url.strip())
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme.lower(), parts.scheme.lower())
    return f"{scheme}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


def join_url(proxy_url: str) -> str:
    return relay_identity(proxy_url) + joining.PATH


def load(state_dir: str) -> Saved | None:
    """The saved credential, or None (none saved; an unreadable file is logged)."""
    path = saved_path(state_dir)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the saved credential %s: %s", path, exc)
        return None
    try:
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        document = json.loads(raw)
        fields = {f.name for f in dataclasses.fields(Saved)}
        saved = Saved(**{k: v for k, v in document.items() if k in fields})
        if not saved.credential.startswith(joining.CREDENTIAL_KIND + "_"):
            raise ValueError("no credential in it")
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring the saved credential %s: %s", path, exc)
        return None
    return saved


def _private_dir(state_dir: str) -> Path:
    """The state directory, created (or narrowed) to mode 0700."""
    folder = Path(state_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = folder.stat().st_mode & 0o777
    if mode & 0o077 and os.name == "posix":
        os.chmod(folder, mode & 0o700)
    return folder


class _Pending:
    """A credential file being written: a temporary file of mode 0600 in the state
    directory, made before the token is spent, moved into place by :meth:`commit`."""

    def __init__(self, state_dir: str) -> None:
        self.folder = _private_dir(state_dir)
        fd, name = tempfile.mkstemp(prefix=".credential-", suffix=".tmp", dir=self.folder)
        os.close(fd)  # mkstemp creates it with mode 0600
        self.temporary = Path(name)

    def commit(self, saved: Saved) -> Path:
        data = json.dumps(dataclasses.asdict(saved), indent=2).encode() + b"\n"
        with self.temporary.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        target = self.folder / FILE
        os.replace(self.temporary, target)
        return target

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.temporary.unlink()


def _message(response: httpx.Response, body: bytes) -> str:
    """The reason in a relay's error answer (its envelope's message), else the status."""
    try:
        document = json.loads(body)
        message = document["error"]["message"]
        if isinstance(message, str) and message:
            return message[:300]
    except (ValueError, TypeError, KeyError):
        pass
    return f"HTTP {response.status_code}"


def _retry_after(response: httpx.Response, fallback: float) -> float:
    try:
        wait = float(response.headers.get("retry-after", ""))
    except ValueError:
        return fallback
    return min(max(wait, fallback), MAX_RETRY_AFTER_SECS)


async def join(config: Config, *, sleep: Callable[[float], Any] = asyncio.sleep) -> Saved:
    """Trade ``config.join_token`` for a credential and save it; the saved record.

    Asks again with backoff while the relay cannot be reached or answers 5xx, after
    ``Retry-After`` when it throttles this address; raises :class:`JoinRefused` when it
    refuses the token.
    """
    assert config.join_token is not None
    url = join_url(config.proxy_url)
    try:
        pending = _Pending(config.state_dir)
    except OSError as exc:
        raise JoinRefused(
            f"cannot keep a credential in {config.state_dir} ({exc}); choose a writable "
            "--state-dir (the join token was not used)"
        ) from exc
    body = joining.encode(joining.JoinRequest(token=config.join_token, name=config.worker_name))
    headers = {
        "content-type": "application/json",
        "user-agent": f"modelrelay-worker/{__version__}",
    }
    delay = config.backoff_min_secs
    timeout = httpx.Timeout(JOIN_TIMEOUT_SECS, connect=config.backend_connect_timeout)
    # The system's certificate store, as the WebSocket connection uses.
    verify = ssl.create_default_context()
    try:
        async with httpx.AsyncClient(timeout=timeout, verify=verify) as client:
            while True:
                wait = delay * (1 + 0.25 * random.random())
                delay = min(delay * 2, max(config.backoff_max_secs, config.backoff_min_secs))
                try:
                    async with client.stream("POST", url, content=body, headers=headers) as r:
                        answer = bytearray()
                        async for chunk in r.aiter_bytes():
                            answer += chunk
                            if len(answer) > joining.MAX_ANSWER_BYTES:
                                raise httpx.DecodingError("the answer is too large")
                        response = r
                except httpx.HTTPError as exc:
                    log.warning("cannot join at %s (%s); retrying in %.1fs", url, exc, wait)
                    await sleep(wait)
                    continue
                status = response.status_code
                if status == 201:
                    try:
                        got = joining.decode_answer(bytes(answer))
                    except msgspec.DecodeError as exc:
                        raise JoinRefused(f"the relay's answer to the join is unusable: {exc}")
                    saved = Saved(
                        proxy_url=relay_identity(config.proxy_url),
                        provider=got.provider,
                        worker_id=got.worker_id,
                        name=got.name,
                        credential=got.credential,
                        token=config.join_token[:TOKEN_PREFIX_LEN],
                        joined_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    )
                    path = pending.commit(saved)
                    log.info(
                        "joined %s as worker %r (id %d) of provider %s; its credential is in "
                        "%s (mode 0600) and the join token is spent",
                        relay_identity(config.proxy_url),
                        saved.name,
                        saved.worker_id,
                        saved.provider,
                        path,
                    )
                    return saved
                reason = _message(response, bytes(answer))
                if status == 429:
                    wait = _retry_after(response, wait)
                    log.warning("join throttled by the relay (%s); retrying in %.0fs", reason, wait)
                elif status >= 500 or status in (404, 408, 425):
                    # 404: a proxy in front answering while the relay restarts, or a relay
                    # too old to know joining (said, in case it stays so).
                    log.warning("cannot join at %s (%s); retrying in %.1fs", url, reason, wait)
                else:
                    raise JoinRefused(f"the relay refused the join token: {reason}")
                await sleep(wait)
    finally:
        pending.discard()


def _same_relay(saved: Saved, config: Config) -> bool:
    return saved.proxy_url == relay_identity(config.proxy_url)


def _with(config: Config, saved: Saved) -> Config:
    return dataclasses.replace(
        config,
        credential=saved.credential,
        provider=saved.provider,
        worker_secret="",
    )


async def settle(config: Config) -> Config:
    """``config`` with the credential to connect with (see the module docstring)."""
    path = saved_path(config.state_dir)
    saved = load(config.state_dir)
    if saved is not None and not _same_relay(saved, config):
        log.warning(
            "the credential in %s is for %s, not %s: not using it",
            path,
            saved.proxy_url,
            relay_identity(config.proxy_url),
        )
        saved = None
    token = config.join_token
    if saved is not None and (token is None or token[:TOKEN_PREFIX_LEN] == saved.token):
        log.info(
            "connecting as worker %r (id %d) of provider %s with the credential in %s%s",
            saved.name,
            saved.worker_id,
            saved.provider,
            path,
            "; WORKER_SECRET is not used" if config.worker_secret else "",
        )
        return _with(config, saved)
    if token is not None:
        if saved is not None:
            log.info("a new join token: joining again (replacing the credential in %s)", path)
        return _with(config, await join(config))
    if not config.worker_secret:
        raise JoinRefused(
            f"no credential for {relay_identity(config.proxy_url)} in {path}: join with "
            "--join-token, or give the provider's --worker-secret"
        )
    return config
