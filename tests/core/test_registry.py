"""Model sanitization, selection and model memory in the worker registry."""

from __future__ import annotations

from relay.core.registry import Registry, sanitize_models
from relay.core.state import Worker
from tests.corekit import RecordingLink


def make_worker(name: str, models: list[str], *, load: int = 0, cap: int = 1) -> Worker:
    worker = Worker(
        id=name,
        provider="p",
        name=name,
        models=tuple(models),
        max_concurrent=cap,
        link=RecordingLink(),
        connected_at=0.0,
        last_pong=0.0,
    )
    worker.report_load(load)
    return worker


def test_sanitize_trims_drops_dedupes_and_caps_in_first_seen_order():
    accepted, warnings = sanitize_models(
        ["  b ", "a", "", "   ", "b", "x" * 300, "c", "d"], cap=3, max_len=256
    )
    assert accepted == ["b", "a", "c"]
    assert warnings == [
        "trimmed whitespace from 2 model name(s)",
        "dropped 2 empty model name(s)",
        "dropped 1 model name(s) longer than 256 characters",
        "dropped 1 duplicate model name(s)",
        "accepted only the first 3 models; dropped 1",
    ]


def test_sanitize_of_a_clean_list_changes_nothing():
    assert sanitize_models(["a", "b"], cap=10, max_len=10) == (["a", "b"], [])


def test_selection_prefers_lowest_load_then_rotates():
    registry = Registry(model_memory=60)
    for name, load in (("a", 1), ("b", 0), ("c", 0)):
        registry.add(make_worker(name, ["m"], load=load, cap=4))
    picks = [registry.select("p", "m").name for _ in range(4)]  # type: ignore[union-attr]
    assert picks == ["b", "c", "b", "c"]


def test_selection_ignores_full_draining_and_unacked_workers():
    registry = Registry(model_memory=60)
    full = make_worker("full", ["m"], load=1, cap=1)
    draining = make_worker("draining", ["m"])
    draining.draining = True
    other = make_worker("other", ["n"])
    for worker in (full, draining, other):
        registry.add(worker)
    assert registry.select("p", "m") is None
    assert registry.select("p", "n") is other


def test_model_memory_remembers_then_forgets():
    registry = Registry(model_memory=10)
    worker = make_worker("a", ["m"])
    registry.add(worker)
    assert registry.serving("p", "m")
    registry.remove(worker, now=100.0)
    assert not registry.serving("p", "m")
    assert registry.remembers("p", "m", now=105.0)
    assert not registry.remembers("p", "m", now=111.0)
    registry.forget_expired(111.0)
    assert registry.remembered() == 0
    assert not registry.remembers("p", "m", now=105.0)  # forgotten for good


def test_model_memory_is_bounded_and_expires_oldest_first():
    registry = Registry(model_memory=10, max_remembered=3)
    for i in range(6):
        worker = make_worker(f"w{i}", [f"m{i}"])
        registry.add(worker)
        registry.remove(worker, now=float(i))
    assert registry.remembered() == 3
    assert [registry.remembers("p", f"m{i}", now=6.0) for i in range(6)] == [False] * 3 + [True] * 3
    worker = make_worker("again", ["m5"])
    registry.add(worker)  # served again: nothing to remember for it
    assert registry.remembered() == 2
    registry.forget_expired(100.0)
    assert registry.remembered() == 0


def test_models_update_reindexes():
    registry = Registry(model_memory=10)
    worker = make_worker("a", ["m"])
    registry.add(worker)
    registry.set_models(worker, ["n"], now=1.0)
    assert registry.select("p", "m") is None
    assert registry.select("p", "n") is worker
    assert registry.models() == {"n": {"p"}}
