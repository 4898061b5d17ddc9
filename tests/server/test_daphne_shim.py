"""The daphne shim's own pieces that can be checked without a server."""

from __future__ import annotations

import os

import pytest

from modelrelay_site.daphne_shim.frames import SMALL_FRAME, SmallMasker


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 125, 126, 1000, SMALL_FRAME])
def test_small_frames_are_unmasked_exactly_as_rfc_6455_says(size):
    mask = os.urandom(4)
    payload = os.urandom(size)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))  # RFC 6455 §5.3
    assert SmallMasker(mask).process(masked) == payload
    for cut in {0, 1, 2, 3, size // 2, size}:  # a frame may arrive in pieces
        masker = SmallMasker(mask)
        assert masker.process(masked[:cut]) + masker.process(masked[cut:]) == payload
        assert masker.pointer() == size


def test_the_small_masker_agrees_with_autobahns_own():
    from autobahn.websocket.xormasker import create_xor_masker

    mask = os.urandom(4)
    payload = os.urandom(700)
    assert SmallMasker(mask).process(payload) == create_xor_masker(mask, 700).process(payload)


# daphne's Server, its real create_application / protocol_disconnected / checker, with
# the shim installed; in a fresh interpreter, since importing daphne.server installs
# Twisted's asyncio reactor.
_REAPING = r"""
import asyncio, json, logging
from daphne.server import Server
from modelrelay_site import daphne_shim

daphne_shim.install()
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


# ----------------------------------------------------------------- probing the patches


def test_every_patch_finds_its_targets_on_the_pinned_versions():
    """The pinned daphne, Twisted and autobahn are the versions the patches were tested
    on, and every private name a patch relies on is there: an upgrade that renames one
    fails here first (and at start the patch is left out, see below)."""
    code = (
        "import daphne.server\n"
        "from modelrelay_site.daphne_shim import patches\n"
        "from modelrelay_site.daphne_shim.probe import missing_targets, untested_versions\n"
        "for p in patches():\n"
        "    print(p.name, '|', missing_targets(p.targets), '|', untested_versions(p.packages))\n"
    )
    result = _python(code)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 8
    for line in lines:
        name, missing, untested = (part.strip() for part in line.split("|"))
        assert (missing, untested) == ("[]", "[]"), name


_PROBE = r"""
import logging, os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "modelrelay_site.settings")
import django
django.setup()
import daphne.server
from daphne.server import Server
from modelrelay_site import daphne_shim
from modelrelay_site.daphne_shim import probe

applied = []
gone = probe.Patch("renamed", ("daphne",), ("daphne.server:Server.no_such_method",),
                   lambda: applied.append("renamed"))
present = probe.Patch("present", ("daphne",), ("daphne.server:Server.handle_reply",),
                      lambda: applied.append("present"))
mode = sys.argv[1]
if mode == "untested":
    probe.TESTED["daphne"] = frozenset({"0.0.1"})
original = Server.handle_reply
print("skipped", daphne_shim.install([gone, present]))
print("applied", applied)
if mode == "all":
    print("skipped", daphne_shim.install())
    print("unchanged", Server.handle_reply is original)
"""


def _python(code: str, *args: str, **env: str):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    return result


def _shim_warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if "daphne shim:" in line]


def test_a_patch_whose_target_is_gone_is_left_out_with_one_warning_naming_it():
    result = _python(_PROBE, "renamed")
    assert "skipped ['renamed']" in result.stdout
    assert "applied ['present']" in result.stdout
    warnings = _shim_warnings(result.stderr)
    assert len(warnings) == 1
    assert "'renamed' left out" in warnings[0]
    assert "daphne.server:Server.no_such_method" in warnings[0]


def test_on_an_untested_version_the_patches_are_left_out_unless_told_otherwise():
    result = _python(_PROBE, "untested")
    assert "skipped ['renamed', 'present']" in result.stdout
    assert "applied []" in result.stdout
    assert "untested version: daphne 4.2.3" in result.stderr
    forced = _python(_PROBE, "untested", DAPHNE_SHIM_UNTESTED="apply").stdout
    assert "applied ['present']" in forced


def test_an_operator_can_leave_every_patch_out():
    result = _python(_PROBE, "all", DAPHNE_SHIM_SKIP="all")
    assert "unchanged True" in result.stdout
    assert len(_shim_warnings(result.stderr)) == 2 + 8


@pytest.mark.live
def test_the_relay_serves_under_daphnes_own_behaviour_with_every_patch_left_out(tmp_path):
    import httpx

    from tests.live import live_server
    from tests.test_e2e import JSON, body_for, poll, routable, running_worker
    from tests.upstream import upstream_in_thread

    with (
        upstream_in_thread(total_slots=2) as up,
        live_server(tmp_path / "server", DAPHNE_SHIM_SKIP="all") as server,
        running_worker(server, up.url),
    ):
        poll(lambda: routable(server), what="the worker to register")
        assert server.log().count("left out, daphne's own behaviour stands") == 8
        for stream in (False, True):
            body = body_for("/v1/chat/completions", stream=stream)
            relayed = httpx.post(
                server.url + "/v1/chat/completions", content=body, headers=JSON, timeout=15
            )
            direct = httpx.post(up.url + "/v1/chat/completions", content=body, timeout=15)
            assert relayed.status_code == 200
            assert relayed.content == direct.content
