"""The daphne shim's own pieces that can be checked without a server."""

from __future__ import annotations

import os

import pytest

from modelrelay_site.daphne_compat import SMALL_FRAME, _SmallMasker


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 125, 126, 1000, SMALL_FRAME])
def test_small_frames_are_unmasked_exactly_as_rfc_6455_says(size):
    mask = os.urandom(4)
    payload = os.urandom(size)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))  # RFC 6455 §5.3
    assert _SmallMasker(mask).process(masked) == payload
    for cut in {0, 1, 2, 3, size // 2, size}:  # a frame may arrive in pieces
        masker = _SmallMasker(mask)
        assert masker.process(masked[:cut]) + masker.process(masked[cut:]) == payload
        assert masker.pointer() == size


def test_the_small_masker_agrees_with_autobahns_own():
    from autobahn.websocket.xormasker import create_xor_masker

    mask = os.urandom(4)
    payload = os.urandom(700)
    assert _SmallMasker(mask).process(payload) == create_xor_masker(mask, 700).process(payload)


# daphne's Server, its real create_application / protocol_disconnected / checker, with
# the shim installed; in a fresh interpreter, since importing daphne.server installs
# Twisted's asyncio reactor.
_REAPING = r"""
import asyncio, json, logging
from daphne.server import Server
from modelrelay_site import daphne_compat

daphne_compat.install()
logging.disable(logging.CRITICAL)


async def ok(scope, receive, send):
    await receive()


async def fails(scope, receive, send):
    await receive()
    raise RuntimeError("boom")


async def main():
    out = {}
    for name, app, disconnect_first in [
        ("ok, client gone first", ok, True),
        ("ok, app done first", ok, False),
        ("raised", fails, True),
    ]:
        server = Server(app, endpoints=["tcp:port=0:interface=127.0.0.1"], signal_handlers=False)
        server.connections = {}  # as Server.run() sets it up
        protocol = object()
        server.protocol_connected(protocol)
        queue = server.create_application(protocol, {"type": "http"})
        instance = server.connections[protocol]["application_instance"]
        if disconnect_first:
            server.protocol_disconnected(protocol)
        await queue.put({"type": "http.request"})
        # The shim's done callback was added first, so it has run when this returns.
        await asyncio.wait([instance])
        if not disconnect_first:
            server.protocol_disconnected(protocol)
        server.protocol_disconnected(protocol)  # a second call is harmless
        out[name] = protocol in server.connections
    print(json.dumps(out))


asyncio.run(main())
"""


def test_a_finished_request_leaves_daphnes_connection_table_at_once():
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _REAPING], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    still_held = json.loads(result.stdout.strip().splitlines()[-1])
    # Clean endings are forgotten whichever of the two ends came last ...
    assert still_held["ok, client gone first"] is False
    assert still_held["ok, app done first"] is False
    # ... and an application that raised stays for daphne's sweep, which logs it.
    assert still_held["raised"] is True
