"""Secrets (worker secrets, client API keys): generated, shown once, stored hashed.

Only a short lookup prefix and ``HMAC-SHA256(pepper, secret)`` are stored. The
pepper lives outside the database (env or a file next to it), so a leaked database
alone cannot be used to test guesses offline. Comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PREFIX_LEN = 12


def generate_secret(kind: str) -> str:
    """A new secret such as ``mrw_…`` (worker) or ``mrk_…`` (API key)."""
    return f"{kind}_{secrets.token_urlsafe(32)}"


def lookup_prefix(secret: str) -> str:
    return secret[:PREFIX_LEN]


def hash_secret(secret: str, pepper: str) -> str:
    return hmac.new(pepper.encode(), secret.encode(), hashlib.sha256).hexdigest()


def verify_secret(secret: str, pepper: str, expected_hash: str) -> bool:
    if not expected_hash:
        return False
    return hmac.compare_digest(hash_secret(secret, pepper), expected_hash)
