"""Workers that cannot take every request for their models (``Worker.refuses``).

A legacy node is one: the core passes it over for what it refuses, in selection and
in the queue, and refuses a request at admission when no connected worker would
ever take it.
"""

from __future__ import annotations

import pytest

from relay.core.state import Phase, RelayRequest
from relay.wire.errors import BadRequest
from tests.corekit import attach, complete, make_relay, submit


def no_tools(request: RelayRequest) -> str | None:
    return "this worker cannot take tools" if "tools" in request.body else None


async def test_selection_passes_over_a_worker_that_refuses_the_request():
    relay = make_relay()
    picky, picky_link = attach(relay, name="picky", max_concurrent=4, refuses=no_tools)
    _, plain_link = attach(relay, name="plain", max_concurrent=4, load=3)
    request = submit(relay, body='{"model":"m","tools":[]}')
    assert request.worker is not None and request.worker.name == "plain"
    assert picky_link.requests == []
    easy = submit(relay)
    assert easy.worker is picky  # lower load, and it takes this one
    assert [r.request_id for r in plain_link.requests] == [request.id]


async def test_a_request_every_connected_worker_refuses_is_a_400_at_once():
    relay = make_relay()
    _, link = attach(relay, name="picky", refuses=no_tools)
    with pytest.raises(BadRequest, match="cannot take tools"):
        submit(relay, body='{"model":"m","tools":[]}')
    assert relay.queue_depth() == 0 and link.requests == []
    assert relay.stats.by_outcome["bad_request"] == 1


async def test_a_refused_request_waits_for_a_worker_that_takes_it_and_skips_the_picky_one():
    relay = make_relay()
    picky, picky_link = attach(relay, name="picky", max_concurrent=2, refuses=no_tools)
    plain, plain_link = attach(relay, name="plain", max_concurrent=1)
    first = submit(relay, body='{"model":"m","tools":[]}')
    assert first.worker is plain
    queued = submit(relay, body='{"model":"m","tools":[1]}')
    assert queued.phase is Phase.QUEUED
    later = submit(relay)  # newer, but the picky worker may take it: FIFO among what it serves
    assert later.worker is picky
    complete(relay, plain, first.id)
    assert queued.worker is plain
    assert [r.request_id for r in picky_link.requests] == [later.id]
    assert [r.request_id for r in plain_link.requests] == [first.id, queued.id]


async def test_a_freed_picky_worker_takes_the_oldest_request_it_accepts():
    relay = make_relay()
    picky, _ = attach(relay, name="picky", max_concurrent=1, refuses=no_tools)
    busy = submit(relay)
    assert busy.worker is picky
    attach(relay, name="plain", max_concurrent=1, load=1)  # full: everything queues
    refused = submit(relay, body='{"model":"m","tools":[]}')
    accepted = submit(relay)
    complete(relay, picky, busy.id)
    assert accepted.worker is picky
    assert refused.phase is Phase.QUEUED


async def test_with_no_worker_connected_a_request_queues_as_before():
    relay = make_relay(declared_models=frozenset({"m"}))
    request = submit(relay, body='{"model":"m","tools":[]}')
    assert request.phase is Phase.QUEUED
    _, link = attach(relay, name="picky", refuses=no_tools)
    assert request.phase is Phase.QUEUED and link.requests == []
