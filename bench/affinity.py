"""(k) Cache-aware routing: conversations back on the box that holds their prefix (SPEC §14).

Each worker's backend is a :class:`tests.cacheupstream.CachingUpstream`: an LRU of
16-token prefix blocks (``k_cache_blocks`` of them) and a time to first token of
``k_cost_us`` µs per prompt token it did not reuse (a sleep: the effect shows on two
cores). Measured, through one daphne process and 2 or 4 ``worker.py``:

- *multi-turn*: ``k_conversations`` concurrent conversations of ``k_turns`` turns
  (a shared system prompt, then each turn a new user message on top of the whole
  history, streamed), under ``ROUTING_POLICY=least_load`` and ``cache_aware``, and
  *pinned* (each conversation straight to one backend, no relay): prompt tokens the
  backends recomputed per turn, and mean time to first token;
- *no shared prefix*: single turns with distinct prompts, a closed loop of 16: req/s
  and mean TTFT under both policies (both servers live, alternating rounds);
- *skew*: one conversation sends four turns at a time beside others sending one, each
  round held at the backends until all of it is in flight: what the hot conversation's
  backend runs against the guard's bound;
- the share of predicted hits the backends confirmed (``/admin/stats``);
- *cluster*: two processes through Redis, one worker each, the turns of each
  conversation alternating between the processes: the share of turns served by the
  worker of the conversation's previous turn;
- *index*: server CPU of the routing work per request for a 32 KB prompt (in process:
  the extra decoding of the prompt's fields, hashing, choice and bookkeeping), and its
  memory after 100,000 distinct conversations against its bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import math
import random
import secrets
import shutil
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import msgspec

from bench.cluster import redis_reachable
from bench.peers import wait_http
from bench.procs import Processes, free_port
from bench.targets import ROOT, WORKER_SECRET, project_python, start_server, wait_workers

MODEL = "mock-model"
CHAT = "/v1/chat/completions"
ADMIN = "bench-admin-token"
SYSTEM = "You are a careful coding agent. Follow the repository's conventions. " * 58


def _start_workers(
    procs: Processes, url: str, backends: list[str], label: str, max_concurrent: int = 64
) -> None:
    for i, backend in enumerate(backends):
        procs.start(
            f"worker-{label}-{i + 1}",
            [
                project_python(),
                "worker.py",
                "--proxy-url",
                url,
                "--worker-secret",
                WORKER_SECRET,
                "--backend-url",
                backend,
                "--models",
                MODEL,
                "--max-concurrent",
                str(max_concurrent),
                "--worker-name",
                f"k-{label}-{i + 1}",
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
        )


async def _turn(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, str]:
    """One streamed turn: (seconds to the first event, the reply's text)."""
    ttft, text, _ = await _stream(client, url, body, first_content=False)
    return ttft, text


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], first_content: bool
) -> tuple[float, str, dict[str, Any]]:
    """One streamed turn: (seconds to the first event, or to the first piece of content
    with ``first_content``; the reply's text; the last ``timings`` the stream carried)."""
    started = time.perf_counter()
    first = None
    text = []
    timings: dict[str, Any] = {}
    async with client.stream("POST", url + CHAT, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            timings = chunk.get("timings") or timings
            if first is None and not first_content:
                first = time.perf_counter() - started
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - started
                text.append(piece)
    ttft = first if first is not None else time.perf_counter() - started
    return ttft, "".join(text), timings


def _user(n: int, t: int, size: int) -> str:
    words = f"conversation {n} turn {t}: please change module {n}-{t} as discussed. "
    return (words * (size // len(words) + 1))[:size]


async def _converse(
    n: int,
    turns: int,
    system: str,
    sizes: tuple[int, int],
    think: float,
    send: Any,
    extra: dict[str, Any] | None = None,
) -> None:
    """Conversation ``n``: ``turns`` streamed turns, each a new user message (the first
    ``sizes[0]`` bytes, carrying the task and its context, later ones ``sizes[1]``) on
    top of the whole history; between two turns it pauses for a time drawn uniformly
    from [0, 2 * ``think``] seconds (its tools run, or its person reads), the same draws
    for every policy. ``await send(n, body)`` returns the reply."""
    pauses = random.Random(n)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for t in range(turns):
        if t and think:
            await asyncio.sleep(pauses.uniform(0, 2 * think))
        messages.append({"role": "user", "content": _user(n, t, sizes[0 if t == 0 else 1])})
        body = {"model": MODEL, "stream": True, **(extra or {}), "messages": messages}
        reply = await send(n, body)
        messages = [*messages, {"role": "assistant", "content": reply}]


async def _conversations(
    url_of: Any,
    count: int,
    turns: int,
    user_bytes: int,
    first_bytes: int,
    base: int = 0,
    think: float = 0.0,
) -> list[float]:
    """``count`` conversations (numbered from ``base``) of ``turns`` turns, all at
    once (see :func:`_converse`). TTFTs."""
    ttfts: list[float] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def send(n: int, body: dict[str, Any]) -> str:
            ttft, reply = await _turn(client, url_of(n), body)
            ttfts.append(ttft)
            return reply

        sizes = (first_bytes, user_bytes)
        await asyncio.gather(
            *(_converse(n, turns, SYSTEM, sizes, think, send) for n in range(base, base + count))
        )
    return ttfts


async def _distinct(url: str, count: int, concurrency: int, size: int) -> dict[str, float]:
    """Single turns with distinct prompts, a closed loop of ``concurrency``."""
    ttfts: list[float] = []
    queue = iter(range(count))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def loop() -> None:
            for i in queue:
                content = f"{i} {secrets.token_hex(size // 2)}"
                body = {
                    "model": MODEL,
                    "stream": True,
                    "messages": [{"role": "user", "content": content}],
                }
                ttfts.append((await _turn(client, url, body))[0])

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {
        "req_per_sec": round(count / wall, 1),
        "ttft_ms": round(1000 * statistics.mean(ttfts), 2),
    }


def _served_summary(served: list[Any]) -> dict[str, float]:
    recomputed = [s.prompt_tokens - s.cached_tokens for s in served]
    return {
        "turns": len(served),
        "prompt_tokens_per_turn": round(statistics.mean(s.prompt_tokens for s in served), 1),
        "recomputed_per_turn": round(statistics.mean(recomputed), 1),
    }


def _routing(url: str) -> dict[str, Any]:
    stats = httpx.get(
        url + "/admin/stats", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10
    )
    return stats.json()["routing"]


def _multi_turn(url_of: Any, pool: Any, s: dict[str, Any], base: int = 0) -> dict[str, Any]:
    before = len(pool.served)
    ttfts = asyncio.run(
        _conversations(
            url_of,
            s["k_conversations"],
            s["k_turns"],
            s["k_user_bytes"],
            s["k_first_bytes"],
            base,
            s["k_think_ms"] / 1000,
        )
    )
    served = pool.served[before:]
    out = _served_summary(served)
    out["ttft_ms"] = round(1000 * statistics.mean(ttfts), 2)
    out["_served"] = served
    return out


def _skew_rounds(url: str, pool: Any, s: dict[str, Any], rounds: int) -> dict[str, Any]:
    """One conversation sends four turns at a time beside ``others`` sending one each.
    Every round the backends hold their answers until all of the round's requests are
    in flight, so what each backend runs is exactly what the relay placed on it; the hot
    conversation's backend is checked against the guard's bound at the end of the round:
    max(ceil(factor * in flight / workers), least + 1 + slack) (what it was when each of
    the hot turns was placed can only be lower)."""
    guard = _routing(url)["guard"]
    others = s["k_skew_others"]
    workers = len(pool.upstreams)
    worst = 0.0
    over = 0
    history: dict[int, list[dict[str, str]]] = {
        n: [{"role": "system", "content": f"Skew conversation {n}. " + SYSTEM}]
        for n in range(others + 1)
    }

    async def round_(r: int) -> list[tuple[int, str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = []
            for n in range(others + 1):
                for k in range(4 if n == 0 else 1):
                    content = _user(n, r * 10 + k, s["k_user_bytes"])
                    body = {
                        "model": MODEL,
                        "stream": True,
                        "messages": [*history[n], {"role": "user", "content": content}],
                    }
                    jobs.append((n, _turn(client, url, body)))
            results = await asyncio.gather(*(job for _, job in jobs))
            return [(n, result[1]) for (n, _), result in zip(jobs, results, strict=True)]

    for r in range(rounds):
        before = len(pool.served)
        pool.hold()
        total = 4 + others
        with concurrent.futures.ThreadPoolExecutor(1) as runner:
            running = runner.submit(asyncio.run, round_(r))
            deadline = time.monotonic() + 60
            while pool.in_flight() < total and time.monotonic() < deadline:
                time.sleep(0.01)
            placed = [up.in_flight for up in pool.upstreams]
            served = pool.served[before:]
            pool.release()
            replies = running.result(120)
        hot_home = next(x.index for x in served if b"Skew conversation 0." in x.body)
        bound = max(
            math.ceil(guard["load_factor"] * sum(placed) / workers),
            min(placed) + 1 + guard["load_slack"],
        )
        worst = max(worst, placed[hot_home] / bound)
        over += placed[hot_home] > bound
        for n, reply in replies[:1] + replies[4:]:
            history[n] = [
                *history[n],
                {"role": "user", "content": _user(n, r * 10, s["k_user_bytes"])},
                {"role": "assistant", "content": reply},
            ]
    return {"rounds": rounds, "worst_load_over_bound": round(worst, 3), "over_bound": over}


def _pinned(backends: list[str]) -> Any:
    return lambda n: backends[n % len(backends)]


def _always(url: str) -> Any:
    return lambda n: url


def _workers() -> list[Any]:
    from relay.core.state import Worker

    return [
        Worker(
            id=f"w{i}",
            provider="p",
            name=f"w{i}",
            models=(MODEL,),
            max_concurrent=64,
            link=None,  # type: ignore[arg-type]
            connected_at=0.0,
            last_pong=0.0,
        )
        for i in range(4)
    ]


def _server_env(policy: str) -> dict[str, str]:
    return {
        "ROUTING_POLICY": policy,
        "MODELRELAY_ADMIN_TOKEN": ADMIN,
        "MAX_QUEUE_LEN": "10000",
        "QUEUE_TIMEOUT_SECS": "120",
    }


def _policies(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    """Per worker count, both policies live at once (each with its own backends) and
    the pinned baseline on a third set, measured in alternating rounds of fresh
    conversations, so that other work on the machine falls on all three alike."""
    from tests.cacheupstream import caching_upstreams

    out: dict[str, Any] = {}
    options = {
        "model": MODEL,
        "cost_per_token": s["k_cost_us"] / 1e6,
        "capacity_blocks": s["k_cache_blocks"],
        "reply_tokens": 48,
    }
    for workers in (2, 4):
        log(f"  {workers} workers: least_load, cache_aware and pinned in alternating rounds")
        with (
            caching_upstreams(workers, **options) as least_pool,
            caching_upstreams(workers, **options) as aware_pool,
            caching_upstreams(workers, **options) as pinned_pool,
        ):
            pools = {"least_load": least_pool, "cache_aware": aware_pool}
            urls = {}
            for policy, pool in pools.items():
                label = f"{policy}-{workers}"
                server, url = start_server(
                    procs, workdir, f"k-{label}", None, "daphne", **_server_env(policy)
                )
                _start_workers(procs, url, [up.url for up in pool.upstreams], label)
                wait_workers(url, workers, server, timeout=90)
                urls[policy] = url
            direct = _pinned([up.url for up in pinned_pool.upstreams])
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in (*urls, "pinned")}
            # Unmeasured: the first requests through a fresh server and worker (their
            # connections, imports, caches) are slower, whatever the policy.
            for target in (*(_always(url) for url in urls.values()), direct):
                asyncio.run(_conversations(target, 4, 2, s["k_user_bytes"], 1000, base=900))
            for r in range(s["k_rounds"]):
                base = 1000 * (r + 1)
                for policy, url in urls.items():
                    runs[policy].append(_multi_turn(_always(url), pools[policy], s, base))
                runs["pinned"].append(_multi_turn(direct, pinned_pool, s, base))
            row: dict[str, Any] = {}
            for policy, results in runs.items():
                served = [x for result in results for x in result.pop("_served")]
                row[policy] = _served_summary(served) | {
                    "ttft_ms": round(statistics.mean(x["ttft_ms"] for x in results), 2),
                    "rounds": results,
                }
            aware = row["cache_aware"]
            routing = _routing(urls["cache_aware"])
            aware["decisions"] = routing["decisions"]
            checked = routing["predicted_hits_confirmed"] + routing["predicted_hits_refuted"]
            aware["predicted_hits_checked"] = checked
            aware["predicted_hits_confirmed_share"] = (
                round(routing["predicted_hits_confirmed"] / checked, 4) if checked else None
            )
            if workers == 2:
                log("    skew: one conversation four turns at a time")
                aware["skew"] = _skew_rounds(urls["cache_aware"], aware_pool, s, s["k_skew_rounds"])
                aware["skew"]["guard_decisions"] = (
                    _routing(urls["cache_aware"])["decisions"]["guard"]
                    - routing["decisions"]["guard"]
                )
                log("    no shared prefix: distinct single turns in alternating rounds")
                out["distinct"] = _distinct_rounds(urls, s)
            procs.stop_all()
        out[f"workers_{workers}"] = row
    return out


def _distinct_rounds(urls: dict[str, str], s: dict[str, Any]) -> dict[str, Any]:
    """Single turns with distinct prompts on both servers, in alternating rounds; the
    best round of each (the least disturbed by other work on the machine)."""
    rounds: dict[str, list[dict[str, float]]] = {policy: [] for policy in urls}
    for _ in range(s["k_distinct_rounds"]):
        for policy, url in urls.items():
            rounds[policy].append(
                asyncio.run(_distinct(url, s["k_distinct"], 16, s["k_distinct_bytes"]))
            )
    return {
        policy: {
            "req_per_sec": max(r["req_per_sec"] for r in runs),
            "ttft_ms": min(r["ttft_ms"] for r in runs),
            "rounds": runs,
        }
        for policy, runs in rounds.items()
    }


def _cluster(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    from tests.cacheupstream import caching_upstreams

    if not redis_reachable():
        return {"skipped": "Redis is not reachable at 127.0.0.1:6379"}
    log("  cluster: two processes, one worker each, turns alternating")
    env = {
        **_server_env("cache_aware"),
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "REDIS_PREFIX": f"bench-{secrets.token_hex(4)}",
        "MODELRELAY_SECRET_PEPPER": secrets.token_urlsafe(32),
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
    }
    with caching_upstreams(
        2, model=MODEL, cost_per_token=s["k_cost_us"] / 1e6, reply_tokens=48
    ) as pool:
        a, a_url = start_server(procs, workdir, "k-cluster-a", None, "daphne", **env)
        shared = {**env, "DATABASE_URL": f"sqlite:///{workdir / 'data-k-cluster-a' / 'db.sqlite3'}"}
        b, b_url = start_server(procs, workdir, "k-cluster-b", None, "daphne", **shared)
        _start_workers(procs, a_url, [pool.upstreams[0].url], "ca")
        _start_workers(procs, b_url, [pool.upstreams[1].url], "cb")
        wait_workers(a_url, 1, a, timeout=90)
        wait_workers(b_url, 1, b, timeout=90)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            listed = httpx.get(
                a_url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5
            ).json()
            if len(listed) == 2:
                break
            time.sleep(0.2)
        turn_of: dict[int, int] = {}

        def url_of(n: int) -> str:
            turn_of[n] = turn_of.get(n, -1) + 1
            return (a_url, b_url)[(turn_of[n] + n) % 2]

        result = _multi_turn(url_of, pool, s)
        served = result.pop("_served")
        result["guard_decisions"] = sum(_routing(u)["decisions"]["guard"] for u in (a_url, b_url))
        procs.stop_all()
    homes: dict[int, list[int]] = {}
    for record in served:
        first_user = json.loads(record.body)["messages"][1]["content"]
        homes.setdefault(int(first_user.split()[1]), []).append(record.index)
    followed = sum(
        1 for seq in homes.values() for prev, cur in itertools.pairwise(seq) if prev == cur
    )
    total = sum(len(seq) - 1 for seq in homes.values())
    result["same_worker_share"] = round(followed / total, 4) if total else None
    return result


def _index_cost(s: dict[str, Any]) -> dict[str, Any]:
    """The routing work of one request for a 32 KB prompt, in this process."""
    from relay.core.affinity import AffinityConfig, Router
    from relay.core.state import RelayRequest
    from relay.server.http.request import _head_decoder

    class _Plain(msgspec.Struct):
        model: Any = msgspec.UNSET
        stream: Any = msgspec.UNSET
        service_tier: Any = None

    plain = msgspec.json.Decoder(_Plain)
    messages = [{"role": "system", "content": SYSTEM[:4000]}]
    messages += [{"role": "user", "content": _user(1, t, 980)} for t in range(30)]
    body = json.dumps({"model": MODEL, "stream": True, "messages": messages}).encode()
    router = Router(AffinityConfig())
    workers = _workers()

    def request() -> RelayRequest:
        return RelayRequest(
            id="r", seq=1, provider="p", model=MODEL, endpoint_path=CHAT, flavor="openai",
            is_streaming=True, body="", headers={}, key_id=None, created_wall=0.0, now=0.0,
            deadline=1.0,
        )  # fmt: skip

    rounds = s["k_index_rounds"]

    def timed(fn: Any) -> float:
        """CPU seconds of this process per call (the best of five passes), so other
        users' work on the machine counts as little as it can."""
        best = math.inf
        for _ in range(5):
            started = time.process_time()
            for _ in range(rounds):
                fn()
            best = min(best, (time.process_time() - started) / rounds)
        return best * 1e6

    decode_plain = timed(lambda: plain.decode(body))
    decode_both = timed(lambda: _head_decoder.decode(body))
    head = _head_decoder.decode(body)

    r = request()

    def route() -> None:
        r.affinity = router.affinity(head, MODEL, None, 1)  # a key's request
        chosen = router.choose(r, workers) or workers[0]
        router.assigned(r, chosen)

    route_us = timed(route)
    return {
        "prompt_bytes": len(body),
        "decode_plain_us": round(decode_plain, 2),
        "decode_with_prompt_fields_us": round(decode_both, 2),
        "route_us": round(route_us, 2),
        "total_extra_us": round(max(0.0, decode_both - decode_plain) + route_us, 2),
    }


def _index_memory(s: dict[str, Any]) -> dict[str, Any]:
    from relay.core.affinity import AffinityConfig, Prompt, Router
    from relay.core.state import RelayRequest

    config = AffinityConfig()
    router = Router(config)
    workers = _workers()
    decoder = msgspec.json.Decoder(Prompt)
    tracemalloc.start()
    count = s["k_memory_conversations"]
    for n in range(count):
        messages = [
            {"role": "system", "content": SYSTEM[:2000]},
            {"role": "user", "content": _user(n, 0, 2000)},
        ]
        body = json.dumps({"model": MODEL, "messages": messages}).encode()
        r = RelayRequest(
            id="r", seq=1, provider="p", model=MODEL, endpoint_path=CHAT, flavor="openai",
            is_streaming=False, body="", headers={}, key_id=None, created_wall=0.0, now=0.0,
            deadline=1.0,
        )  # fmt: skip
        r.affinity = router.affinity(decoder.decode(body), MODEL, f"session-{n}", None)
        router.assigned(r, workers[n % 4])
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    bound_entries = 4 * config.worker_blocks + config.max_keys
    return {
        "conversations": count,
        "workers": 4,
        "entries": router.entries(),
        "entry_bound": bound_entries,
        "traced_bytes": current,
        "bytes_per_entry": round(current / max(1, router.entries()), 1),
    }


def run(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "settings": {k: v for k, v in s.items() if k.startswith("k_") and not isinstance(v, dict)}
    }
    log("  index cost and memory (in process)")
    out["index"] = _index_cost(s)
    out["memory"] = _index_memory(s)
    policies = _policies(procs, workdir, s, log)
    out["distinct"] = policies.pop("distinct")
    out["policies"] = policies
    if redis_reachable():
        from bench.affinity_redis import measure

        log("  Redis: the placement script with and without an anchor; a shared block index")
        out["redis"] = measure(calls=s["k_redis_calls"])
    out["cluster"] = _cluster(procs, workdir, s, log)
    out["llama_server"] = _llama(procs, workdir, s, log)
    return out


# --------------------------------------------------------------------------- real llama-server

LLAMA_DIR = ROOT / ".bench-cache" / "llama-server"
LLAMA_SLOTS = 4
#: Host-memory prompt cache per server (--cache-ram), MiB: with this model a token's KV is
#: 1 KiB, so 32 MiB keeps about 32,000 tokens of other conversations' prompts.
LLAMA_CACHE_MIB = 32


def llama_server() -> tuple[str, Path] | str:
    """(the llama-server binary, the tiny model) or why they are not there."""
    binary = shutil.which("llama-server") or str(LLAMA_DIR / "bin" / "llama-server")
    model = LLAMA_DIR / "tiny.gguf"
    if not Path(binary).is_file():
        return "no llama-server binary on this machine: `make llama-server` builds one"
    if not model.is_file():
        return "no model for it: `make llama-server` writes one"
    return binary, model


def _start_llamas(procs: Processes, binary: str, model: Path, count: int, label: str) -> list[str]:
    """``count`` llama-servers, one thread each, LLAMA_SLOTS slots of 8192 tokens and a
    prompt cache of LLAMA_CACHE_MIB."""
    urls = []
    for i in range(count):
        port = free_port()
        proc = procs.start(
            f"llama-{label}-{i + 1}",
            [
                binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "--threads", "1", "--threads-batch", "1", "--parallel", str(LLAMA_SLOTS),
                "--ctx-size", str(8192 * LLAMA_SLOTS), "--cache-ram", str(LLAMA_CACHE_MIB),
                "--seed", "1", "--no-webui",
            ],
        )  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
        wait_http(urls[-1] + "/health", proc, timeout=60)
    return urls


async def _llama_turn(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[float, str, int, int]:
    """One streamed turn against llama-server, directly or through the relay: (seconds
    to the first piece of content, the reply, prompt tokens processed, reused) as the
    server's ``timings`` report them."""
    ttft, text, timings = await _stream(client, url, body, first_content=True)
    return ttft, text, int(timings.get("prompt_n", 0)), int(timings.get("cache_n", 0))


async def _llama_conversations(url_of: Any, s: dict[str, Any], base: int) -> dict[str, Any]:
    """Agent-shaped conversations (a shared system prompt, a long first turn, short
    later ones, a pause between turns) against llama-servers."""
    system = SYSTEM[: s["k_llama_system_bytes"]]
    ttfts: list[float] = []
    recomputed: list[int] = []
    reused: list[int] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def send(n: int, body: dict[str, Any]) -> str:
            ttft, reply, processed, cached = await _llama_turn(client, url_of(n), body)
            ttfts.append(ttft)
            recomputed.append(processed)
            reused.append(cached)
            return reply

        sizes = (s["k_llama_first_bytes"], s["k_llama_user_bytes"])
        think = s["k_think_ms"] / 1000
        extra = {"max_tokens": 16, "temperature": 0}
        await asyncio.gather(
            *(
                _converse(n, s["k_llama_turns"], system, sizes, think, send, extra)
                for n in range(base, base + s["k_llama_conversations"])
            )
        )
    return {"ttfts": ttfts, "recomputed": recomputed, "reused": reused}


def _llama(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    """The multi-turn workload against two real llama-servers: least-load, cache-aware
    and pinned, each on freshly started backends (empty caches), in that order."""
    found = llama_server()
    if isinstance(found, str):
        return {"skipped": found}
    binary, model = found
    workers = 2
    log(f"  real llama-server: {workers} backends, {LLAMA_SLOTS} slots each")
    out: dict[str, Any] = {
        "workers": workers,
        "slots": LLAMA_SLOTS,
        "cache_mib": LLAMA_CACHE_MIB,
        "model": "random weights: 2 layers, 128 wide, one token per byte",
    }
    for policy in ("least_load", "cache_aware", "pinned"):
        results: list[dict[str, Any]] = []
        backends = _start_llamas(procs, binary, model, workers, policy)
        if policy == "pinned":
            target = _pinned(backends)
        else:
            server, url = start_server(
                procs, workdir, f"k-llama-{policy}", None, "daphne", **_server_env(policy)
            )
            _start_workers(procs, url, backends, f"llama-{policy}", LLAMA_SLOTS)
            wait_workers(url, workers, server, timeout=90)
            target = _always(url)
        for r in range(s["k_llama_rounds"]):
            results.append(asyncio.run(_llama_conversations(target, s, 1000 * (r + 1))))
        procs.stop_all()
        ttfts = [x for r in results for x in r["ttfts"]]
        recomputed = [x for r in results for x in r["recomputed"]]
        reused = [x for r in results for x in r["reused"]]
        out[policy] = {
            "turns": len(ttfts),
            "prompt_tokens_per_turn": round(
                statistics.mean(recomputed) + statistics.mean(reused), 1
            ),
            "recomputed_per_turn": round(statistics.mean(recomputed), 1),
            "ttft_ms": round(1000 * statistics.mean(ttfts), 2),
        }
    return out
