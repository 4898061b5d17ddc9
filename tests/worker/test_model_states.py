"""Models on demand (SPEC §19, the ``model_states`` extension): the real worker against
the scripted relay of test_worker.py and fakes of Ollama, llama-swap, vLLM and
llama-server's router (tests/modelhosts.py).

Each kind: the states at ``register``, a change the backend makes by itself reaching the
relay as a ``model_states`` frame, a load and an unload on the relay's word answered by
one ``model_result`` each, a load the backend fails. Polls are shrunk to milliseconds
through the worker's flags; tests wait on frames, never on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

import worker
from relay.wire.protocol import (
    MAX_MODEL_STATES,
    MODEL_STATES,
    ModelLoad,
    ModelResult,
    ModelsRefresh,
    ModelStates,
    ModelsUpdate,
    ModelUnload,
    Register,
    ResponseChunk,
    ResponseComplete,
)
from relay.worker.announcer import MODEL_STATES_INTERVAL_SECS
from relay.worker.backend import BackendNotReady
from relay.worker.modelhost import MAX_ANSWER_BYTES, call
from relay.worker.operations import MAX_OPS_IN_FLIGHT, MAX_WAITING_OPS
from relay.worker.outbox import encode
from tests.modelhosts import FakeLlamaRouter, FakeLlamaSwap, FakeOllama, FakeVllm
from tests.stall import STALL_BUDGET_MS, LoopStalls
from tests.upstream import FakeUpstream
from tests.worker.test_worker import CHAT, FakeRelay, RelaySide, config

#: Polls in milliseconds; the safety-net read behind events stays slow, so a change a
#: test sees quickly on an event backend came through its events.
QUICK = ["--model-poll-secs", "0.02", "--model-refresh-secs", "30", "--model-op-timeout-secs", "5"]


@contextlib.asynccontextmanager
async def serving(backend_url: str, *flags: str) -> AsyncIterator[tuple[worker.Worker, RelaySide]]:
    """A registered worker in this loop, and the relay's side of its connection."""
    async with FakeRelay() as relay:
        instance = worker.Worker(config(relay.url, backend_url, *QUICK, *flags))
        task = asyncio.create_task(instance.run())
        try:
            yield instance, await relay.registered()
        finally:
            task.cancel()
            await asyncio.wait([task])


def states(frame: ModelStates | Register | None) -> dict[str, str]:
    """Model -> state, as a ``register`` or a ``model_states`` frame says."""
    assert frame is not None
    listed = frame.model_states if isinstance(frame, Register) else frame.states
    assert listed is not None
    return {s.model: s.state for s in listed}


async def states_where(
    side: RelaySide, check: Callable[[dict[str, str]], bool], timeout: float = 5.0
) -> ModelStates:
    return await side.wait_for(ModelStates, lambda f: check(states(f)), timeout)


async def result(side: RelaySide, op_id: str, timeout: float = 5.0) -> ModelResult:
    return await side.wait_for(ModelResult, lambda r: r.op_id == op_id, timeout)


def results(side: RelaySide, op_id: str) -> list[ModelResult]:
    return [m for m in side.received if isinstance(m, ModelResult) and m.op_id == op_id]


async def load(side: RelaySide, model: str, op_id: str) -> None:
    await side.send(ModelLoad(model=model, op_id=op_id))


async def unload(side: RelaySide, model: str, op_id: str) -> None:
    await side.send(ModelUnload(model=model, op_id=op_id))


# --------------------------------------------------------------------------- plain


async def test_a_plain_backend_registers_as_before_and_refuses_model_ops() -> None:
    async with FakeUpstream(models=["a", "b"]) as up, serving(up.url) as (_, side):
        assert side.register is not None
        assert side.register.models == ["a", "b"]
        assert side.register.model_states is None and side.register.model_capacity is None
        assert MODEL_STATES not in side.register.features
        await load(side, "a", "op-1")
        answer = await result(side, "op-1")
        assert (answer.ok, answer.op, answer.model) == (False, "load", "a")
        assert answer.error is not None and "does not load" in answer.error
        assert [r.path for r in up.requests if r.method == "POST"] == []


async def test_model_states_off_registers_an_on_demand_backend_as_plain() -> None:
    ollama = FakeOllama({"a": "loaded", "b": "loadable"})
    async with ollama as up, serving(up.url, "--no-model-states") as (_, side):
        assert side.register is not None
        assert side.register.model_states is None
        assert MODEL_STATES not in side.register.features
        assert side.register.models == ["a", "b"]


# --------------------------------------------------------------------------- Ollama


async def test_ollama_registers_each_model_with_its_state_and_the_given_capacity() -> None:
    ollama = FakeOllama({"a": "loaded", "b": "loadable"})
    async with ollama as up, serving(up.url, "--models-max", "2") as (_, side):
        register = side.register
        assert register is not None
        assert MODEL_STATES in register.features
        assert register.models == ["a", "b"]
        assert states(register) == {"a": "loaded", "b": "loadable"}
        assert register.model_capacity == 2


async def test_a_model_another_client_loads_reaches_the_relay() -> None:
    async with FakeOllama({"a": "loaded", "b": "loadable"}) as up, serving(up.url) as (_, side):
        assert side.register is not None and side.register.model_capacity is None
        up.set_state("b", "loaded")  # someone ran `ollama run b` on the box
        frame = await states_where(side, lambda s: s.get("b") == "loaded")
        assert states(frame) == {"a": "loaded", "b": "loaded"}  # always the whole list
        up.set_state("a", "loadable")  # and Ollama's keep_alive ran out for a
        await states_where(side, lambda s: s == {"a": "loadable", "b": "loaded"})


async def test_ollama_loads_and_unloads_on_the_relays_word_one_result_each() -> None:
    async with FakeOllama({"a": "loaded", "b": "loadable"}) as up, serving(up.url) as (_, side):
        up.gate.clear()
        await load(side, "b", "op-1")
        # Ollama lists a model only once in memory: the worker says "loading" meanwhile.
        await states_where(side, lambda s: s.get("b") == "loading")
        up.gate.set()
        loaded = await result(side, "op-1")
        assert (loaded.ok, loaded.op, loaded.model, loaded.state) == (True, "load", "b", "loaded")
        assert loaded.error is None and loaded.duration_ms is not None
        await states_where(side, lambda s: s == {"a": "loaded", "b": "loaded"})

        await unload(side, "a", "op-2")
        unloaded = await result(side, "op-2")
        assert (unloaded.ok, unloaded.op, unloaded.state) == (True, "unload", "loadable")
        assert up.ops == [("load", "b"), ("unload", "a")]
        generate = [r.json() for r in up.requests_to("/api/generate")]
        assert generate == [{"model": "b"}, {"model": "a", "keep_alive": 0}]

        await side.ping(1)  # every frame sent before the pong has arrived
        assert len(results(side, "op-1")) == len(results(side, "op-2")) == 1


async def test_a_load_of_a_loaded_model_and_an_unload_of_an_idle_one_cost_nothing() -> None:
    async with FakeOllama({"a": "loaded", "b": "loadable"}) as up, serving(up.url) as (_, side):
        await load(side, "a", "op-1")
        await unload(side, "b", "op-2")
        assert (await result(side, "op-1")).ok and (await result(side, "op-2")).ok
        assert up.ops == []


async def test_a_load_the_backend_fails_is_answered_with_its_reason() -> None:
    async with FakeOllama({"a": "loaded", "b": "loadable"}) as up, serving(up.url) as (_, side):
        up.failing["b"] = "model requires more system memory (12 GiB) than is available"
        await load(side, "b", "op-1")
        answer = await result(side, "op-1")
        assert (answer.ok, answer.state) == (False, "loadable")
        assert answer.error is not None and "more system memory" in answer.error
        # The relay heard "loading" at the start; it hears the state after, too.
        await states_where(side, lambda s: s == {"a": "loaded", "b": "loadable"})


async def test_an_op_for_a_model_the_backend_lacks_is_refused_and_nothing_is_kept() -> None:
    async with FakeOllama({"a": "loaded"}) as up, serving(up.url) as (instance, side):
        for i in range(50):
            await load(side, f"missing-{i}", f"op-{i}")
        answers = [await result(side, f"op-{i}") for i in range(50)]
        assert all(not a.ok and a.error == "the backend has no such model" for a in answers)
        assert all(a.state == "" for a in answers)
        await side.ping(1)
        assert instance.operations._turns == {}  # nothing is kept for a name from the relay
        assert up.ops == []


async def test_ops_on_one_model_run_one_after_the_other_in_the_order_they_came() -> None:
    async with FakeOllama({"a": "loaded", "b": "loadable"}) as up, serving(up.url) as (_, side):
        up.gate.clear()
        await load(side, "b", "op-1")
        await load(side, "b", "op-2")
        await unload(side, "b", "op-3")
        await up.wait_requests(1, path="/api/generate")
        up.gate.set()
        answers = [await result(side, f"op-{i}") for i in (1, 2, 3)]
        assert [(a.ok, a.state) for a in answers] == [
            (True, "loaded"),
            (True, "loaded"),
            (True, "loadable"),
        ]
        order = [m.op_id for m in side.received if isinstance(m, ModelResult)]
        assert order == ["op-1", "op-2", "op-3"]
        # The second load waited for the first and found the model loaded.
        assert up.ops == [("load", "b"), ("unload", "b")]


async def test_ops_past_the_waiting_bound_of_one_model_are_refused_at_once() -> None:
    async with FakeOllama({"a": "loaded", "b": "loadable"}) as up, serving(up.url) as (_, side):
        up.gate.clear()
        count = MAX_WAITING_OPS + 2  # one runs, MAX_WAITING_OPS wait, one too many
        for i in range(count):
            await load(side, "b", f"op-{i}")
        refused = await result(side, f"op-{count - 1}")
        assert not refused.ok and refused.error is not None and "waiting" in refused.error
        assert not [m for m in side.received if isinstance(m, ModelResult) and m.ok]
        up.gate.set()
        assert all([(await result(side, f"op-{i}")).ok for i in range(count - 1)])


async def test_ops_past_the_bound_of_one_connection_are_refused_at_once() -> None:
    names = [f"m{i}" for i in range(20)]
    async with FakeOllama(dict.fromkeys(names, "loadable")) as up, serving(up.url) as (_, side):
        up.gate.clear()
        for i in range(MAX_OPS_IN_FLIGHT):
            await load(side, names[i % len(names)], f"op-{i}")
        await load(side, names[0], "op-over")
        refused = await result(side, "op-over")
        assert not refused.ok and f"more than {MAX_OPS_IN_FLIGHT}" in (refused.error or "")
        up.gate.set()
        answers = [await result(side, f"op-{i}") for i in range(MAX_OPS_IN_FLIGHT)]
        assert all(a.ok for a in answers)
        assert sorted(model for _, model in up.ops) == sorted(names)  # one load each


async def test_a_burst_of_changes_goes_out_coalesced_and_always_whole() -> None:
    names = [f"m{i}" for i in range(12)]
    async with FakeOllama(dict.fromkeys(names, "loadable")) as up, serving(up.url) as (_, side):
        started = time.monotonic()
        for name in names:  # one change per poll, faster than frames may go out
            up.set_state(name, "loaded")
            await up.wait_requests(len(up.requests_to("/api/ps")) + 1, path="/api/ps")
        last = await states_where(side, lambda s: set(s.values()) == {"loaded"})
        elapsed = time.monotonic() - started
        frames = [m for m in side.received if isinstance(m, ModelStates)]
        assert all(set(states(f)) == set(names) for f in frames)
        assert frames[-1] is last
        # The first goes at once, the rest at most one per MODEL_STATES_INTERVAL_SECS.
        assert len(frames) <= 1 + math.ceil(elapsed / MODEL_STATES_INTERVAL_SECS)
        assert len(frames) < len(names)


async def test_a_backend_that_refuses_connections_withdraws_then_resends_its_states() -> None:
    up = await FakeOllama({"a": "loaded", "b": "loadable"}).start()
    port = int(up.url.rsplit(":", 1)[1])
    probe = ["--backend-probe-min-secs", "0.01", "--backend-probe-max-secs", "0.05"]
    try:
        async with serving(up.url, *probe) as (_, side):
            await up.close()
            gone = await side.wait_for(ModelsUpdate, lambda u: u.models == [])
            assert gone.backend_error
            up = await FakeOllama({"a": "loadable", "b": "loaded"}).start(port)
            await states_where(side, lambda s: s == {"a": "loadable", "b": "loaded"})
    finally:
        await up.close()


async def test_a_relay_without_the_extension_hears_model_names_as_before() -> None:
    async with (
        FakeOllama({"a": "loaded", "b": "loadable"}) as up,
        FakeRelay(features=[]) as relay,  # acks no extension
    ):
        cfg = config(relay.url, up.url, *QUICK)
        task = asyncio.create_task(worker.Worker(cfg).run())
        try:
            side = await relay.registered()
            assert side.register is not None and side.register.models == ["a", "b"]
            up.set_state("b", "loaded")
            up.states["c"] = "loadable"  # a model pulled meanwhile
            update = await side.wait_for(ModelsUpdate)
            assert update.models == ["a", "b", "c"]
            await side.send(ModelsRefresh(reason="test"))
            assert (await side.wait_for(ModelsUpdate)).models == ["a", "b", "c"]
            await side.ping(1)
            assert not [m for m in side.received if isinstance(m, ModelStates)]
        finally:
            task.cancel()
            await asyncio.wait([task])


# --------------------------------------------------------------------------- llama-swap


async def test_llama_swap_reports_its_own_models_and_loads_through_upstream() -> None:
    swap = FakeLlamaSwap({"qwen": "ready", "llama": "stopped"}, peers=["far-model"])
    async with swap as up, serving(up.url, "--models-max", "1") as (_, side):
        assert side.register is not None
        assert states(side.register) == {"qwen": "loaded", "llama": "loadable"}
        assert side.register.models == ["qwen", "llama"]  # the peer's model is not this box's
        assert side.register.model_capacity == 1

        up.gate.clear()
        await load(side, "llama", "op-1")
        await states_where(side, lambda s: s.get("llama") == "loading")
        up.gate.set()
        answer = await result(side, "op-1")
        assert (answer.ok, answer.state) == (True, "loaded")
        assert up.requests_to("/upstream/llama/health")

        await unload(side, "qwen", "op-2")
        assert (await result(side, "op-2")).state == "loadable"
        assert up.requests_to("/api/models/unload/qwen")

        up.set_state("llama", "stopped")  # its ttl ran out
        await states_where(side, lambda s: s == {"qwen": "loadable", "llama": "loadable"})


async def test_a_llama_swap_without_single_unloads_says_so() -> None:
    async with FakeLlamaSwap({"qwen": "ready"}) as up, serving(up.url) as (_, side):
        up.unload_one = False
        await unload(side, "qwen", "op-1")
        answer = await result(side, "op-1")
        assert not answer.ok and answer.error is not None and "upgrade" in answer.error
        assert answer.state == "loaded"
        assert not up.requests_to("/unload")  # never the unload-everything route


async def test_a_failed_llama_swap_start_is_answered_with_its_reason() -> None:
    async with FakeLlamaSwap({"qwen": "stopped"}) as up, serving(up.url) as (_, side):
        up.failing["qwen"] = "upstream command exited prematurely"
        await load(side, "qwen", "op-1")
        answer = await result(side, "op-1")
        assert not answer.ok and "exited prematurely" in (answer.error or "")


# --------------------------------------------------------------------------- vLLM


async def test_vllm_sleep_mode_puts_the_model_to_sleep_and_wakes_it() -> None:
    async with FakeVllm("llama3-8b") as up, serving(up.url) as (_, side):
        assert side.register is not None
        assert states(side.register) == {"llama3-8b": "loaded"}
        await unload(side, "llama3-8b", "op-1")
        slept = await result(side, "op-1")
        assert (slept.ok, slept.state) == (True, "sleeping")
        await states_where(side, lambda s: s == {"llama3-8b": "sleeping"})
        await load(side, "llama3-8b", "op-2")
        woke = await result(side, "op-2")
        assert (woke.ok, woke.state) == (True, "loaded")
        assert [op for op, _ in up.ops] == ["sleep?level=1", "wake_up"]


async def test_vllm_lora_adapters_are_models_loaded_from_their_paths() -> None:
    async with FakeVllm("base") as up:
        flags = ["--lora-adapters", "sql=/loras/sql, chat=/loras/chat"]
        async with serving(up.url, *flags) as (_, side):
            assert states(side.register) == {
                "base": "loaded",
                "sql": "loadable",
                "chat": "loadable",
            }
            await load(side, "sql", "op-1")
            assert (await result(side, "op-1")).state == "loaded"
            assert up.paths == {"sql": "/loras/sql"}
            await states_where(side, lambda s: s["sql"] == "loaded")
            await unload(side, "sql", "op-2")
            assert (await result(side, "op-2")).state == "loadable"
            # The base sleeps, its adapters with it; loading one wakes the base.
            up.set_state("chat", "loaded")
            await unload(side, "base", "op-3")
            assert (await result(side, "op-3")).state == "sleeping"
            await states_where(
                side, lambda s: s == {"base": "sleeping", "sql": "loadable", "chat": "sleeping"}
            )
            await load(side, "chat", "op-4")
            assert (await result(side, "op-4")).state == "loaded"
            assert not up.sleeping


async def test_vllm_without_sleep_mode_cannot_free_its_base_model() -> None:
    vllm = FakeVllm("base", sleep_mode=False)
    async with vllm as up, serving(up.url, "--lora-adapters", "sql=/loras/sql") as (_, side):
        await unload(side, "base", "op-1")
        answer = await result(side, "op-1")
        assert not answer.ok and "--enable-sleep-mode" in (answer.error or "")
        assert answer.state == "loaded"


async def test_vllm_with_neither_sleep_mode_nor_adapters_is_plain() -> None:
    async with FakeVllm("base", sleep_mode=False) as up, serving(up.url) as (_, side):
        assert side.register is not None and side.register.model_states is None
        assert side.register.models == ["base"]


# --------------------------------------------------------------------------- a fake router


async def test_router_states_and_slots_follow_its_events_without_polling() -> None:
    router = FakeLlamaRouter({"a": "loaded", "b": "unloaded"}, models_max=2, slots=3)
    async with router as up, serving(up.url, "--model-poll-secs", "30") as (instance, side):
        register = side.register
        assert register is not None
        assert [(s.model, s.state, s.slots) for s in register.model_states or []] == [
            ("a", "loaded", 3),
            ("b", "loadable", None),
        ]
        assert register.model_capacity == 2
        assert register.max_concurrent == 3  # the loaded models' slots
        up.set_state("b", "loaded")  # another client's request loaded it
        frame = await states_where(side, lambda s: s.get("b") == "loaded", timeout=3)
        assert [s.slots for s in frame.states] == [3, 3]
        assert frame.max_concurrent == 6
        assert instance.max_concurrent == 6
        up.set_state("a", "unloaded")  # an operator unloaded it
        frame = await states_where(side, lambda s: s.get("a") == "loadable", timeout=3)
        assert frame.max_concurrent == 3


async def test_a_router_with_no_model_yet_is_recognised_and_its_new_models_reported() -> None:
    async with FakeLlamaRouter({}, models_max=2) as up, serving(up.url) as (_, side):
        assert side.register is not None
        assert side.register.model_states == [] and side.register.model_capacity == 2
        up.states["fresh"] = "unloaded"  # a file dropped into --models-dir, then a reload
        up.notify("*", "models_reload")
        update = await side.wait_for(ModelsUpdate, timeout=3)
        assert update.models == ["fresh"]
        await states_where(side, lambda s: s == {"fresh": "loadable"}, timeout=3)


async def test_a_router_whose_event_stream_fails_is_polled_meanwhile() -> None:
    router = FakeLlamaRouter({"a": "unloaded"})
    router.events_broken = True
    async with router as up, serving(up.url) as (instance, side):
        up.set_state("a", "loaded")  # no event reaches the worker: the poll sees it
        await states_where(side, lambda s: s == {"a": "loaded"})
        up.events_broken = False  # back: the poll behind the events slows down again
        async with asyncio.timeout(5):
            while instance.tracker._interval != instance.config.model_refresh_secs:
                await up.wait_requests(len(up.requests) + 1)


async def test_a_router_without_an_event_stream_is_polled() -> None:
    async with FakeLlamaRouter({"a": "unloaded"}, events=False) as up, serving(up.url) as (_, side):
        assert side.register is not None and side.register.max_concurrent == 1
        up.set_state("a", "loaded")
        await states_where(side, lambda s: s == {"a": "loaded"})


async def test_a_router_load_evicts_and_is_answered_once_the_model_is_in_memory() -> None:
    router = FakeLlamaRouter({"a": "loaded", "b": "unloaded"}, models_max=1)
    async with router as up, serving(up.url) as (_, side):
        up.gate.clear()
        await load(side, "b", "op-1")
        await states_where(side, lambda s: s == {"a": "loadable", "b": "loading"})
        up.gate.set()
        answer = await result(side, "op-1")
        assert (answer.ok, answer.state) == (True, "loaded")
        assert up.requests_to("/models/load")[0].json() == {"model": "b"}


async def test_a_sleeping_router_model_is_woken_by_a_load_and_freed_by_an_unload() -> None:
    router = FakeLlamaRouter({"a": "sleeping", "b": "sleeping"})
    async with router as up, serving(up.url) as (_, side):
        assert states(side.register) == {"a": "sleeping", "b": "sleeping"}
        await load(side, "a", "op-1")
        woke = await result(side, "op-1")
        assert (woke.ok, woke.state) == (True, "loaded")
        assert up.requests_to("/slots")[0].query == "model=a&autoload=false"
        # Asleep, b still counts against --models-max: its unload frees it.
        await unload(side, "b", "op-2")
        freed = await result(side, "op-2")
        assert (freed.ok, freed.state) == (True, "loadable")
        assert up.ops == [("unload", "b")]


async def test_a_router_load_whose_child_exits_is_answered_with_the_exit_code() -> None:
    async with FakeLlamaRouter({"a": "unloaded"}) as up, serving(up.url) as (_, side):
        up.failing["a"] = "boom"
        await load(side, "a", "op-1")
        answer = await result(side, "op-1")
        assert (answer.ok, answer.state) == (False, "loadable")
        assert "exited with code 1" in (answer.error or "")


async def test_a_stream_the_router_cuts_ends_with_an_error_event_and_a_502() -> None:
    router = FakeLlamaRouter({"a": "loaded"})
    router.hold_streams = True
    async with router as up, serving(up.url) as (_, side):
        await side.request("r-1", CHAT, stream=True, extra={"model": "a"})
        await side.wait_for(ResponseChunk, lambda c: c.request_id == "r-1")
        async with httpx.AsyncClient() as client:  # an operator unloads the model
            answer = await client.post(up.url + "/models/unload", json={"model": "a"})
            assert answer.status_code == 200
        complete = await side.complete("r-1")
        assert complete.status_code == 502
        text = "".join(side.chunks("r-1"))
        assert "[DONE]" not in text
        # The router's bare "proxy error" line is closed off: the error is an event.
        *_, junk, error, rest = text.split("\n\n")
        assert (junk, rest) == ("proxy error: Failed to read connection", "")
        assert error.startswith('data: {"error":') and "before its last event" in error


# --------------------------------------------------------------------------- bounds


@pytest.mark.parametrize("count", [MAX_MODEL_STATES, MAX_MODEL_STATES + 1])
async def test_the_most_models_a_list_may_hold_cost_no_loop_stall(count: int) -> None:
    names = [f"model-{i:05d}" for i in range(count)]
    ollama = FakeOllama(dict.fromkeys(names, "loadable"))
    async with ollama as up, serving(up.url, "--model-poll-secs", "30") as (instance, side):
        assert side.register is not None
        assert len(side.register.model_states or []) == MAX_MODEL_STATES
        assert (side.register.model_states or [])[-1].model == names[MAX_MODEL_STATES - 1]
        up.set_state(names[0], "loaded")
        async with LoopStalls() as stalls:
            await instance.tracker.refresh()
            frame = encode(instance.tracker.frame())
        assert stalls.longest_ms < STALL_BUDGET_MS, stalls.longest_ms
        assert len(frame) < instance.config.max_message_bytes


@pytest.mark.parametrize("size", [MAX_ANSWER_BYTES, MAX_ANSWER_BYTES + 1])
async def test_a_state_answer_is_read_up_to_its_bound(size: int) -> None:
    padding = b'{"models":[],"pad":"' + b"x" * (size - 22) + b'"}'
    assert len(padding) == size

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + padding)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/api/ps"
    try:
        async with httpx.AsyncClient() as client:
            if size <= MAX_ANSWER_BYTES:
                status, document = await call(client, "GET", url, secs=5)
                assert status == 200 and document["models"] == []
            else:
                with pytest.raises(BackendNotReady, match="larger than"):
                    await call(client, "GET", url, secs=5)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_stream_that_ends_cleanly_but_short_is_a_failure_on_any_backend() -> None:
    async with FakeLlamaRouter({"a": "loaded"}) as up, serving(up.url) as (_, side):
        await side.request("r-1", CHAT, stream=True, extra={"model": "a"})
        complete = await side.complete("r-1")
        assert complete.status_code == 200  # a whole stream passes as before
        assert isinstance(complete, ResponseComplete)
