"""The fair wait queue (SPEC §6, §13): its order and the bound it guarantees, alone."""

from __future__ import annotations

import itertools
import random
from collections import Counter

from relay.core.fairqueue import FairQueue
from relay.core.limits import Ticket
from relay.core.state import RelayRequest

_seq = itertools.count(1)


class _Tickets:
    """Stands in for the limiter: only ``finished`` is called, by ``Ticket.close``."""

    def finished(self, ticket: Ticket, tokens: int) -> None:
        pass


def request(key: int | None = None, model: str = "m", *, weight: int = 1) -> RelayRequest:
    r = RelayRequest(
        id=f"r{next(_seq)}",
        seq=next(_seq),
        provider="local",
        model=model,
        endpoint_path="/v1/chat/completions",
        flavor="openai",
        is_streaming=False,
        body="{}",
        headers={},
        key_id=key,
        created_wall=0.0,
        now=0.0,
        deadline=10.0,
    )
    if key is not None:
        r.ticket = Ticket(_Tickets(), key, weight, held=False)  # type: ignore[arg-type]
    return r


def pop_all(queue: FairQueue, models: frozenset[str] = frozenset({"m"})) -> list[RelayRequest]:
    out = []
    while (r := queue.pop_for(models)) is not None:
        out.append(r)
    return out


def test_without_keys_it_is_the_oldest_request_the_worker_serves():
    queue = FairQueue()
    a1, b1, a2, c1 = request(model="a"), request(model="b"), request(model="a"), request(model="c")
    for r in (a1, b1, a2, c1):
        queue.push(r)
    assert queue.next_for(frozenset({"b", "c"})) is b1
    assert queue.pop_for(frozenset({"b", "c"})) is b1
    assert queue.pop_for(frozenset({"c", "a"})) is a1
    assert queue.pop_for(frozenset({"x"})) is None
    assert pop_all(queue, frozenset({"a", "c"})) == [a2, c1]
    assert len(queue) == 0


def test_keys_take_turns_one_request_each_by_default():
    queue = FairQueue()
    a = [request(1) for _ in range(4)]
    b = [request(2) for _ in range(2)]
    c = [request(3)]
    for r in a + b + c:
        queue.push(r)
    assert pop_all(queue) == [a[0], b[0], c[0], a[1], b[1], a[2], a[3]]


def test_weights_give_turns_in_proportion():
    queue = FairQueue()
    heavy = [request(1, weight=3) for _ in range(30)]
    light = [request(2) for _ in range(30)]
    for r in heavy + light:
        queue.push(r)
    order = [r.key_id for r in pop_all(queue)[:40]]
    assert order[:8] == [1, 1, 1, 2, 1, 1, 1, 2]
    assert Counter(order) == {1: 30, 2: 10}


def test_requeued_requests_go_ahead_of_every_key_in_arrival_order():
    queue = FairQueue()
    waiting = [request(1), request(2)]
    lost_late, lost_early = request(3), request(3)
    lost_early.seq, lost_late.seq = 0, 1_000_000
    for r in (lost_late, lost_early):
        r.worker_id = "w-gone"  # it was dispatched before: a requeue
    for r in (*waiting, lost_late, lost_early):
        queue.push(r)
    assert pop_all(queue) == [lost_early, lost_late, *waiting]


def test_fifo_within_a_key_among_the_models_the_worker_serves():
    queue = FairQueue()
    x1, y1, x2, y2 = request(1, "x"), request(1, "y"), request(1, "x"), request(1, "y")
    for r in (x1, y1, x2, y2):
        queue.push(r)
    assert queue.pop_for(frozenset({"y"})) is y1
    assert queue.pop_for(frozenset({"x", "y"})) is x1
    assert queue.pop_for(frozenset({"x", "y"})) is x2
    assert queue.pop_for(frozenset({"x"})) is None
    assert queue.pop_for(frozenset({"y"})) is y2


def test_a_key_the_worker_cannot_serve_is_skipped_and_keeps_its_place():
    queue = FairQueue()
    big = [request(1, "big") for _ in range(3)]
    small = [request(2, "small") for _ in range(3)]
    for r in big + small:
        queue.push(r)
    # A worker with only "small" skips key 1, which stays in front for "big" workers.
    assert queue.pop_for(frozenset({"small"})) is small[0]
    assert queue.pop_for(frozenset({"small", "big"})) is big[0]
    assert queue.pop_for(frozenset({"small", "big"})) is small[1]


def test_a_lone_request_waits_behind_at_most_one_request_per_other_active_key():
    """The bound of relay.core.fairqueue with every weight 1: a request of a key with
    nothing queued is dispatched after at most one request of each key that had
    requests waiting when it arrived, and after none of any key that came later."""
    rng = random.Random(7)
    for _ in range(50):
        queue = FairQueue()
        keys = list(range(1, rng.randint(2, 12)))
        for _ in range(rng.randint(1, 300)):
            queue.push(request(rng.choice(keys)))
        for _ in range(rng.randint(0, 40)):  # some turns already taken
            queue.pop_for(frozenset({"m"}))
        active = {k for k in queue.depth_by_key() if k is not None}
        lone = request(999)
        queue.push(lone)
        for _ in range(rng.randint(0, 20)):  # keys that come later
            queue.push(request(rng.randint(1000, 1010)))
        ahead = []
        while (r := queue.pop_for(frozenset({"m"}))) is not lone:
            assert r is not None
            ahead.append(r.key_id)
        assert all(count == 1 for count in Counter(ahead).values())
        assert set(ahead) <= active


def test_with_weights_a_lone_request_waits_behind_at_most_each_keys_weight():
    queue = FairQueue()
    for _ in range(100):
        queue.push(request(1, weight=5))
        queue.push(request(2, weight=2))
    lone = request(3)
    queue.push(lone)
    ahead: Counter[int | None] = Counter()
    while (r := queue.pop_for(frozenset({"m"}))) is not lone:
        assert r is not None
        ahead[r.key_id] += 1
    assert ahead == {1: 5, 2: 2}


def test_cancelled_requests_leave_without_costing_their_key_a_turn():
    queue = FairQueue()
    a1, a2, b1 = request(1), request(1), request(2)
    for r in (a1, a2, b1):
        queue.push(r)
    assert queue.depth_by_key() == {1: 2, 2: 1}
    assert queue.remove(a1) and not queue.remove(a1)
    assert len(queue) == 2
    assert pop_all(queue) == [a2, b1]
    lost = request(4)
    lost.worker_id = "w"
    queue.push(lost)
    assert queue.depth_by_key() == {4: 1}
    assert queue.remove(lost) and len(queue) == 0 and queue.depth_by_key() == {}


def test_iterating_lists_the_dispatch_order_and_drain_empties():
    queue = FairQueue()
    requests = [request(k % 3 + 1, weight=2 if k % 3 == 0 else 1) for k in range(12)]
    for r in requests:
        queue.push(r)
    queue.pop_for(frozenset({"m"}))  # mid-turn: the iteration starts from where it is
    listed = list(queue)
    assert listed == [*queue.drain()]
    assert len(queue) == 0 and list(queue) == []
    replay = FairQueue()
    for r in requests:
        replay.push(r)
    replay.pop_for(frozenset({"m"}))
    assert pop_all(replay) == listed


def test_a_key_whose_weight_changes_takes_the_new_weight_on_its_next_turn():
    queue = FairQueue()
    for _ in range(4):
        queue.push(request(1, weight=1))
    for _ in range(8):
        queue.push(request(2))
    for _ in range(8):
        queue.push(request(1, weight=3))
    order = [r.key_id for r in pop_all(queue)][:9]
    assert order == [1, 2, 1, 1, 1, 2, 1, 1, 1]
