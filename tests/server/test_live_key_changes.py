"""A key change made through the admin API is in force on the process that answered it
the moment the call returns: a new key works on the next request, a revoked one is
refused, with no wait for the next periodic sync (SPEC §8)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.live

ADMIN = "key-changes-admin"
ROUNDS = 10


def test_a_key_works_as_soon_as_it_is_created_and_stops_as_soon_as_it_is_revoked(
    relay_server_factory,
):
    # A long sync period: only the admin call's own wait can make the change visible.
    with relay_server_factory(
        MODELRELAY_REQUIRE_API_KEYS="true", MODELRELAY_ADMIN_TOKEN=ADMIN, SYNC_SECS="30"
    ) as server:
        admin = {"authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=server.url, timeout=10) as http:
            for i in range(ROUNDS):
                made = http.post("/admin/keys", json={"name": f"k{i}"}, headers=admin)
                assert made.status_code == 201, made.text
                auth = {"authorization": f"Bearer {made.json()['secret']}"}
                assert http.get("/v1/models", headers=auth).status_code == 200, i
                changed = http.patch(
                    f"/admin/keys/{made.json()['id']}", json={"name": f"k{i}-b"}, headers=admin
                )
                assert changed.status_code == 200, changed.text
                gone = http.delete(f"/admin/keys/{made.json()['id']}", headers=admin)
                assert gone.status_code == 204
                refused = http.get("/v1/models", headers=auth)
                assert refused.status_code == 401, (i, refused.text)
