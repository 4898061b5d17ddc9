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
