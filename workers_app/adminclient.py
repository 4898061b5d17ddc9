"""A small client for the running server's admin API, used by ``manage.py`` commands.

Commands that act on live workers cannot touch them directly (the workers are
connected to the server process), so they go through ``/admin/*``. Every failure
becomes a one-line ``CommandError`` that says what to do.
"""

from __future__ import annotations

from typing import Any

import httpx
from django.conf import settings
from django.core.management.base import CommandError


def default_server() -> str:
    host, _, port = settings.LISTEN_ADDR.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class AdminClient:
    def __init__(self, server: str | None = None, token: str | None = None) -> None:
        self.base = (server or default_server()).rstrip("/")
        self.token = token or settings.MODELRELAY_ADMIN_TOKEN
        if not self.token:
            raise CommandError(
                "MODELRELAY_ADMIN_TOKEN is not set: this command talks to the running "
                "server's admin API and needs the same token"
            )
        self._http = httpx.Client(
            base_url=self.base,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=httpx.Timeout(10.0),
        )

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CommandError(
                f"cannot reach the ModelRelay server at {self.base} ({exc.__class__.__name__}); "
                "is it running? (use --server URL)"
            ) from None
        if response.status_code == 403:
            raise CommandError(f"the server at {self.base} refused the admin token (403)")
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise CommandError(f"{detail} (HTTP {response.status_code})")
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    def workers(self) -> list[dict[str, Any]]:
        workers: list[dict[str, Any]] = self.request("GET", "/admin/workers")
        return workers

    def close(self) -> None:
        self._http.close()
