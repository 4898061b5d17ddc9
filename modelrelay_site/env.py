"""Typed readers for environment settings.

Every reader takes an explicit default and fails loudly (``ImproperlyConfigured``)
with the variable's name when a value is present but malformed, so a typo in a
deployment never silently falls back to a default.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return value.strip()


def env_str(name: str, default: str) -> str:
    value = _raw(name)
    return default if value is None or value == "" else value


def env_int(name: str, default: int, *, minimum: int | None = 0) -> int:
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        parsed = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and parsed < minimum:
        raise ImproperlyConfigured(f"{name} must be >= {minimum}, got {parsed}")
    return parsed


def env_float(name: str, default: float, *, minimum: float = 0.0, positive: bool = True) -> float:
    """Read a number of seconds; decimals are accepted (``0.25``)."""
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {value!r}") from None
    if parsed != parsed or parsed in (float("inf"), float("-inf")):
        raise ImproperlyConfigured(f"{name} must be a finite number, got {value!r}")
    if positive and parsed <= 0:
        raise ImproperlyConfigured(f"{name} must be greater than 0, got {value!r}")
    if parsed < minimum:
        raise ImproperlyConfigured(f"{name} must be >= {minimum}, got {value!r}")
    return parsed


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, got {value!r}")


def env_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def env_aliases(name: str) -> dict[str, str]:
    """A JSON object of model aliases, ``{"public name": "backend model id", ...}``."""
    import json

    value = _raw(name)
    if value is None or not value.strip():
        return {}
    try:
        document = json.loads(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a JSON object: {exc}") from None
    if not isinstance(document, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k.strip() and v.strip()
        for k, v in document.items()
    ):
        raise ImproperlyConfigured(
            f'{name} must map model names to model names, e.g. {{"gpt-4o-mini": "qwen2.5-7b"}}'
        )
    return {k.strip(): v.strip() for k, v in document.items()}


def persisted_secret(path: Path, *, nbytes: int = 32, prefix: str = "") -> str:
    """Return the secret stored at ``path``, generating it (mode 0600) on first use.

    Used for values that must survive restarts but must never be hard-coded:
    Django's SECRET_KEY, the HMAC pepper and the default worker secret.
    """
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    value = prefix + secrets.token_urlsafe(nbytes)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        # Another process won the race to create it: use theirs.
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    return value
