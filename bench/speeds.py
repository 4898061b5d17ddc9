"""(n) Speed-aware routing: mixed boxes, deadlines, hedged stalls (SPEC §21).

Each worker's backend is a :class:`tests.cacheupstream.CachingUpstream` that processes
one prompt at a time (a GPU's compute) at ``n_cost_us`` µs per prompt token, divided by
its speed, and streams its reply a token every ``n_decode_ms`` ms (also divided by its
speed). The workload is open-loop: Poisson arrivals at a rate that keeps the pool
``n_load`` busy (what its prompts would take at the speed of each box, all of them),
70 % short prompts (``n_short_bytes``) and 30 % long ones (``n_long_bytes``), every
prompt new (nothing cached), the same schedule for every policy. Measured, through one
daphne process and one ``worker.py`` per box:

- *mixed pools* (speeds 1x and 3x, then 1x, 1x, 2x and 4x) and *identical* (1x, 1x):
  ``ROUTING_POLICY=least_load`` against ``predicted``, each with its own server and
  backends, in alternating rounds after an unmeasured warm-up (the predicted one learns
  its speeds then): mean and p95 time to first token;
- *deadlines*: the mixed pool of two under ``predicted``, every request stating a
  deadline at the p90 of least-load's times, one in ten an impossible one (20 ms): the
  share of admitted requests that met theirs, and how fast the others were refused;
- *hedging*: two identical boxes, one of which holds one request in twenty for
  ``n_stall_secs`` before answering; ``priority`` streams of short prompts, with
  HEDGE_MAX_SHARE=0 and 0.05: p99 time to first token and the backend requests beyond
  the clients';
- *conversations*: (k)'s agent-shaped conversations on two identical boxes whose fakes
  keep a prompt cache, ``cache_aware`` against ``predicted``: prompt tokens recomputed
  per turn and mean time to first token (does the prediction keep what the cache gives);
- *real llama-servers*: a pair (`make llama-server`), one with one thread and one with
  two, least-load against predicted;
- *routing cost*: the CPU of choosing a worker by prediction and learning from the
  answer, in process, against cache-aware routing's (today's default), 4 workers.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.affinity import CHAT, MODEL, llama_server
from bench.peers import wait_http
from bench.procs import Processes, free_port
from bench.targets import ROOT, WORKER_SECRET, project_python, start_server, wait_workers

ADMIN = "bench-admin-token"
#: The pools, by name: each box's speed, and how busy the workload keeps the pool (None:
#: ``n_load``; the heavier pass shows where the gain shrinks, and is not judged).
POOLS: dict[str, tuple[list[float], float | None]] = {
    "mixed_2": ([1.0, 3.0], None),
    "mixed_4": ([1.0, 1.0, 2.0, 4.0], None),
    "identical_2": ([1.0, 1.0], None),
    "mixed_2_heavy": ([1.0, 3.0], 0.5),
}
BYTES_PER_TOKEN = 4  # (the fake's own count: one token per four characters)


def _server_env(policy: str, **extra: str) -> dict[str, str]:
    return {
        "ROUTING_POLICY": policy,
        "MODELRELAY_ADMIN_TOKEN": ADMIN,
        "MAX_QUEUE_LEN": "10000",
        "QUEUE_TIMEOUT_SECS": "120",
        **extra,
    }


def _start_workers(procs: Processes, url: str, backends: list[str], label: str, slots: int) -> None:
    for i, backend in enumerate(backends):
        procs.start(
            f"worker-{label}-{i + 1}",
            [
                project_python(), "worker.py", "--proxy-url", url, "--worker-secret",
                WORKER_SECRET, "--backend-url", backend, "--models", MODEL,
                "--max-concurrent", str(slots), "--worker-name", f"n-{label}-{i + 1}",
                "--log-level", "warning",
            ],
            cwd=ROOT,
        )  # fmt: skip


def _schedule(
    s: dict[str, Any],
    speeds: list[float],
    seed: int,
    *,
    count: int | None = None,
    seconds: float | None = None,
    short_only: bool = False,
    bytes_per_token: float = BYTES_PER_TOKEN,
    load: float | None = None,
) -> list[tuple[float, int]]:
    """Arrivals ``(offset seconds, prompt bytes)``, ``count`` of them or ``seconds``
    worth: Poisson at the rate that keeps the pool ``n_load`` busy (``load``, if given)."""
    draw = random.Random(seed)
    cost = s["n_cost_us"] / 1e6
    if short_only:
        mean_tokens = s["n_short_bytes"] / bytes_per_token
    else:
        mean_tokens = (0.7 * s["n_short_bytes"] + 0.3 * s["n_long_bytes"]) / bytes_per_token
    rate = (load or s["n_load"]) * sum(speeds) / (mean_tokens * cost)
    if count is None:
        count = max(1, math.ceil(rate * (seconds or 1.0)))
    at = 0.0
    out = []
    for _ in range(count):
        at += draw.expovariate(rate)
        long = not short_only and draw.random() < 0.3
        out.append((at, s["n_long_bytes"] if long else s["n_short_bytes"]))
    return out


async def _one(
    client: httpx.AsyncClient, url: str, size: int, tag: str, headers: dict[str, str]
) -> dict[str, Any]:
    """One streamed request with a new prompt of ``size`` bytes: its status, time to the
    first byte of its answer (of the whole answer when refused)."""
    content = f"{tag} " + ("lorem ipsum dolor " * (size // 18 + 1))[:size]
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 16,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }
    started = time.perf_counter()
    first = None
    async with client.stream("POST", url + CHAT, json=body, headers=headers) as response:
        async for chunk in response.aiter_bytes():
            if first is None and chunk:
                first = time.perf_counter() - started
        status = response.status_code
    ended = time.perf_counter() - started
    return {"status": status, "ttft": first if first is not None else ended, "total": ended}


async def _run(
    url: str,
    schedule: list[tuple[float, int]],
    tag: str,
    headers_of: Any = None,
) -> list[dict[str, Any]]:
    """Send ``schedule`` (open loop: each at its time, whatever the others do)."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()

        async def at(i: int, offset: float, size: int) -> dict[str, Any]:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            headers = headers_of(i, size) if headers_of is not None else {}
            result = await _one(client, url, size, f"{tag}-{i}", headers)
            return result | {"size": size, "headers": headers}

        return await asyncio.gather(*(at(i, o, size) for i, (o, size) in enumerate(schedule)))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r["ttft"] for r in results if r["status"] == 200]
    return {
        "requests": len(results),
        "errors": sum(1 for r in results if r["status"] != 200),
        "mean_ttft_ms": round(1000 * statistics.mean(ok), 1) if ok else None,
        "p50_ttft_ms": round(1000 * _pct(ok, 0.5), 1) if ok else None,
        "p90_ttft_ms": round(1000 * _pct(ok, 0.9), 1) if ok else None,
        "p95_ttft_ms": round(1000 * _pct(ok, 0.95), 1) if ok else None,
        "p99_ttft_ms": round(1000 * _pct(ok, 0.99), 1) if ok else None,
    }


def _pools(count: int, speeds: list[float], s: dict[str, Any], **extra: Any) -> Any:
    from tests.cacheupstream import caching_upstreams

    return caching_upstreams(
        count,
        speeds=speeds,
        model=MODEL,
        cost_per_token=s["n_cost_us"] / 1e6,
        decode_per_token=s["n_decode_ms"] / 1000,
        reply_tokens=s["n_reply_tokens"],
        serial_prefill=True,
        capacity_blocks=64,
        **extra,
    )


def _admin(url: str, path: str) -> Any:
    return httpx.get(url + path, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).json()


def _policies(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    """Per pool: least_load and predicted, each its own server and backends, alternating
    rounds on the same schedules; the deadline pass on the mixed pool of two."""
    out: dict[str, Any] = {}
    for name, (speeds, load) in POOLS.items():
        busy = load or s["n_load"]
        log(
            f"  {name} (speeds {speeds}, {100 * busy:.0f} % busy): least_load and predicted "
            "in alternating rounds"
        )
        with (
            _pools(len(speeds), speeds, s) as least_pool,
            _pools(len(speeds), speeds, s) as predicted_pool,
        ):
            pools = {"least_load": least_pool, "predicted": predicted_pool}
            urls = {}
            for policy, pool in pools.items():
                label = f"{name}-{policy}"
                server, url = start_server(
                    procs, workdir, f"n-{label}", None, "daphne", **_server_env(policy)
                )
                _start_workers(procs, url, [up.url for up in pool.upstreams], label, s["n_slots"])
                wait_workers(url, len(speeds), server, timeout=90)
                urls[policy] = url
            for policy, url in urls.items():  # unmeasured: first requests, learning
                warm = _schedule(s, speeds, 7, count=s["n_warmup"], load=load)
                asyncio.run(_run(url, warm, f"warm-{name}-{policy}"))
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in urls}
            for r in range(s["n_rounds"]):
                schedule = _schedule(s, speeds, 100 + r, seconds=s["n_seconds"], load=load)
                for policy, url in urls.items():
                    runs[policy] += asyncio.run(_run(url, schedule, f"{name}-{policy}-{r}"))
            row: dict[str, Any] = {"speeds": speeds, "load": busy}
            for policy, results in runs.items():
                row[policy] = _summary(results)
                served = pools[policy].served
                row[policy]["share_by_box"] = [
                    round(sum(1 for x in served if x.index == i) / max(1, len(served)), 3)
                    for i in range(len(speeds))
                ]
            learned = _admin(urls["predicted"], "/admin/workers")
            row["learned_prefill_tokens_per_sec"] = {
                w["name"]: w["speeds"][0]["prefill_tokens_per_sec"] for w in learned
            }
            row["true_prefill_tokens_per_sec"] = [round(v * 1e6 / s["n_cost_us"]) for v in speeds]
            for policy in urls:
                r_ = row[policy]
                log(
                    f"    {policy}: mean {r_['mean_ttft_ms']} ms, p95 {r_['p95_ttft_ms']} ms, "
                    f"{r_['errors']} errors, share by box {r_['share_by_box']}"
                )
            if name == "mixed_2":
                log("    deadlines at least-load's p90, one in ten impossible (20 ms)")
                row["deadlines"] = d = _deadlines(urls["predicted"], row["least_load"], speeds, s)
                log(
                    f"    {d['met']} of {d['admitted']} admitted met {d['deadline_ms']} ms; "
                    f"{d['refused']} refused, slowest in {d['refusal_ms_max']} ms"
                )
            procs.stop_all()
        out[name] = row
    return out


def _deadlines(
    url: str, least: dict[str, Any], speeds: list[float], s: dict[str, Any]
) -> dict[str, Any]:
    deadline_ms = max(1, int(least["p90_ttft_ms"]))

    def headers_of(i: int, size: int) -> dict[str, str]:
        impossible = i % 10 == 9
        return {"X-Deadline-Ms": "20" if impossible else str(deadline_ms)}

    schedule = _schedule(s, speeds, 500, seconds=s["n_seconds"])
    results = asyncio.run(_run(url, schedule, "deadline", headers_of))
    admitted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 503]
    met = sum(1 for r in admitted if 1000 * r["ttft"] <= int(r["headers"]["X-Deadline-Ms"]))
    return {
        "deadline_ms": deadline_ms,
        "requests": len(results),
        "admitted": len(admitted),
        "met": met,
        "met_share": round(met / len(admitted), 4) if admitted else None,
        "refused": len(refused),
        "refused_impossible": sum(1 for r in refused if r["headers"]["X-Deadline-Ms"] == "20"),
        "refusal_ms_max": round(1000 * max(r["total"] for r in refused), 1) if refused else None,
        "refusal_ms_p50": round(1000 * _pct([r["total"] for r in refused], 0.5), 1)
        if refused
        else None,
        "other_errors": sum(1 for r in results if r["status"] not in (200, 503)),
        "stats": _admin(url, "/admin/stats")["speed"]["deadlines"],
    }


def _hedging(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    log(f"  hedging: one box of two stalls 1 in 20 for {s['n_stall_secs']} s")
    speeds = [1.0, 1.0]
    out: dict[str, Any] = {"stall_secs": s["n_stall_secs"], "stall_every": 20}
    with (
        _pools(2, speeds, s) as off_pool,
        _pools(2, speeds, s) as on_pool,
    ):
        pools = {"off": off_pool, "on": on_pool}
        priority = {"X-Priority": "priority"}
        urls = {}
        for mode, pool in pools.items():
            share = "0" if mode == "off" else str(s["n_hedge_share"])
            server, url = start_server(
                procs, workdir, f"n-hedge-{mode}", None, "daphne",
                **_server_env("predicted", HEDGE_MAX_SHARE=share),
            )  # fmt: skip
            _start_workers(procs, url, [up.url for up in pool.upstreams], f"hedge-{mode}", 8)
            wait_workers(url, 2, server, timeout=90)
            urls[mode] = url
            warm = _schedule(s, speeds, 9, count=s["n_warmup"], short_only=True)
            # (default class: the share's credit starts from the measured requests alone)
            asyncio.run(_run(url, warm, f"warm-hedge-{mode}"))
            pool.set(0, stall_every=20, stall_secs=s["n_stall_secs"])
        for mode, url in urls.items():
            before = len(pools[mode].served)
            schedule = _schedule(s, speeds, 900, count=s["n_hedge_requests"], short_only=True)
            results = asyncio.run(_run(url, schedule, f"hedge-{mode}", lambda i, n: priority))
            backend = len(pools[mode].served) - before
            out[mode] = summary = _summary(results) | {
                "backend_requests": backend,
                "extra_backend_share": round(backend / len(results) - 1, 4),
                "stalled": sum(1 for x in pools[mode].served[before:] if x.stalled),
                "hedges": _admin(url, "/admin/stats")["speed"]["hedges"],
            }
            log(
                f"    hedging {mode}: p99 {summary['p99_ttft_ms']} ms, backend requests "
                f"{backend} for {len(results)}"
            )
        procs.stop_all()
    return out


def _conversations(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    """(k)'s agent-shaped conversations on two identical caching boxes, ``cache_aware``
    against ``predicted``: does the prediction keep what the cache gives?"""
    from bench.affinity import _always, _conversations, _multi_turn
    from tests.cacheupstream import caching_upstreams

    log("  conversations on identical caching boxes: cache_aware and predicted")
    options = {
        "model": MODEL,
        "cost_per_token": s["k_cost_us"] / 1e6,
        "capacity_blocks": s["k_cache_blocks"],
        "reply_tokens": 48,
    }
    out: dict[str, Any] = {}
    with (
        caching_upstreams(2, **options) as aware_pool,
        caching_upstreams(2, **options) as predicted_pool,
    ):
        pools = {"cache_aware": aware_pool, "predicted": predicted_pool}
        urls = {}
        for policy, pool in pools.items():
            server, url = start_server(
                procs, workdir, f"n-conv-{policy}", None, "daphne", **_server_env(policy)
            )
            _start_workers(procs, url, [up.url for up in pool.upstreams], f"conv-{policy}", 64)
            wait_workers(url, 2, server, timeout=90)
            urls[policy] = url
            asyncio.run(_conversations(_always(url), 4, 2, s["k_user_bytes"], 1000, base=900))
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in urls}
        for r in range(s["n_conversation_rounds"]):
            for policy, url in urls.items():
                result = _multi_turn(_always(url), pools[policy], s, 1000 * (r + 1))
                result.pop("_served")
                runs[policy].append(result)
        for policy, results in runs.items():
            out[policy] = {
                "turns": sum(x["turns"] for x in results),
                "recomputed_per_turn": round(
                    statistics.mean(x["recomputed_per_turn"] for x in results), 1
                ),
                "prompt_tokens_per_turn": results[0]["prompt_tokens_per_turn"],
                "ttft_ms": round(statistics.mean(x["ttft_ms"] for x in results), 1),
            }
            log(
                f"    {policy}: {out[policy]['recomputed_per_turn']} recomputed / turn, "
                f"mean TTFT {out[policy]['ttft_ms']} ms"
            )
        procs.stop_all()
    return out


def _start_llama(
    procs: Processes, binary: str, model: Path, label: str, threads: int, slots: int
) -> str:
    port = free_port()
    proc = procs.start(
        f"llama-{label}",
        [
            binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads),
            "--parallel", str(slots), "--ctx-size", str(8192 * slots), "--seed", "1",
            "--no-webui", "--cache-ram", "0",
        ],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, timeout=60)
    return url


def _llama(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    found = llama_server()
    if isinstance(found, str):
        return {"skipped": found}
    binary, model = found
    log("  real llama-servers: one with 1 thread, one with 2; least_load then predicted")
    out: dict[str, Any] = {"threads": [1, 2], "slots": 2}
    llama_s = dict(s) | {
        "n_short_bytes": s["n_llama_short_bytes"],
        "n_long_bytes": s["n_llama_long_bytes"],
        "n_cost_us": s["n_llama_cost_us"],
    }
    for policy in ("least_load", "predicted"):
        backends = [
            _start_llama(procs, binary, model, f"{policy}-{i}", threads, 2)
            for i, threads in enumerate((1, 2))
        ]
        server, url = start_server(
            procs, workdir, f"n-llama-{policy}", None, "daphne", **_server_env(policy)
        )
        _start_workers(procs, url, backends, f"llama-{policy}", 2)
        wait_workers(url, 2, server, timeout=90)
        warm = _schedule(llama_s, [1.0, 1.0], 11, count=s["n_llama_warmup"], bytes_per_token=1)
        asyncio.run(_run(url, warm, f"warm-llama-{policy}"))
        results = []
        for r in range(s["n_llama_rounds"]):
            schedule = _schedule(
                llama_s, [1.0, 1.0], 1100 + r, seconds=s["n_llama_seconds"], bytes_per_token=1
            )
            results += asyncio.run(_run(url, schedule, f"llama-{policy}-{r}"))
        out[policy] = _summary(results)
        log(
            f"    {policy}: mean {out[policy]['mean_ttft_ms']} ms, p95 {out[policy]['p95_ttft_ms']}"
        )
        if policy == "predicted":
            out["learned_prefill_tokens_per_sec"] = {
                w["name"]: w["speeds"][0]["prefill_tokens_per_sec"]
                for w in _admin(url, "/admin/workers")
            }
        procs.stop_all()
    return out


def _routing_cost(s: dict[str, Any]) -> dict[str, Any]:
    """The CPU of one request's routing, in process: cache-aware (affinity, choice,
    record) against predicted (the same affinity, the prediction's choice, its record,
    and learning from the answer), 4 workers, a 32 KB prompt."""
    from bench.affinity import SYSTEM, _user
    from relay.core.affinity import AffinityConfig, Router
    from relay.core.prediction import Predictor, prompt_bytes
    from relay.core.rates import Rates
    from relay.core.speed import SpeedConfig
    from relay.core.state import RelayRequest, Worker
    from relay.server.http.request import _head_decoder
    from relay.wire.protocol import TokenCounts

    messages = [{"role": "system", "content": SYSTEM[:4000]}]
    messages += [{"role": "user", "content": _user(1, t, 980)} for t in range(30)]
    body = json.dumps({"model": MODEL, "stream": True, "messages": messages}).encode()
    head = _head_decoder.decode(body)

    def workers() -> list[Worker]:
        return [
            Worker(
                id=f"w{i}", provider="p", name=f"w{i}", models=(MODEL,), max_concurrent=64,
                link=None, connected_at=0.0, last_pong=0.0,  # type: ignore[arg-type]
            )
            for i in range(4)
        ]  # fmt: skip

    def request() -> RelayRequest:
        return RelayRequest(
            id="r", seq=1, provider="p", model=MODEL, endpoint_path=CHAT, flavor="openai",
            is_streaming=True, body="", headers={}, key_id=None, created_wall=0.0, now=0.0,
            deadline=1.0,
        )  # fmt: skip

    rounds = s["n_cost_rounds"]

    def timed(fn: Any) -> float:
        best = math.inf
        for _ in range(5):
            started = time.process_time()
            for _ in range(rounds):
                fn()
            best = min(best, (time.process_time() - started) / rounds)
        return best * 1e6

    aware_router = Router(AffinityConfig(policy="cache_aware"))
    aware_workers = workers()
    r1 = request()

    def cache_aware() -> None:
        r1.affinity = aware_router.affinity(head, MODEL, None, 1)
        chosen = aware_router.choose(r1, aware_workers) or aware_workers[0]
        aware_router.assigned(r1, chosen)

    router = Router(AffinityConfig(policy="predicted"))
    rates = Rates(SpeedConfig())
    predictor = Predictor(rates, router)
    pool = workers()
    r2 = request()
    counts = TokenCounts(prompt_tokens=8000, completion_tokens=16, cached_tokens=7000)
    clock = [0.0]

    def predicted() -> None:
        clock[0] += 0.01
        now = clock[0]
        r2.affinity = router.affinity(head, MODEL, None, 1)
        r2.prompt_bytes = prompt_bytes(head, "")
        chosen = predictor.choose(r2, pool, now, MODEL) or pool[0]
        r2.assigned_at = now
        predictor.assigned(r2, chosen, now)
        router.assigned(r2, chosen)
        r2.first_byte_at = now + 0.005
        predictor.started(r2, chosen, now + 0.005)
        rates.observe(r2, chosen, counts, now + 0.01, 200)

    aware_us = timed(cache_aware)
    predicted_us = timed(predicted)
    return {
        "prompt_bytes": len(body),
        "workers": 4,
        "cache_aware_us": round(aware_us, 2),
        "predicted_us": round(predicted_us, 2),
        "extra_us": round(predicted_us - aware_us, 2),
    }


def run(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "settings": {k: v for k, v in s.items() if k.startswith("n_") and not isinstance(v, dict)}
    }
    log("  routing cost (in process)")
    out["cost"] = _routing_cost(s)
    out["pools"] = _policies(procs, workdir, s, log)
    out["hedging"] = _hedging(procs, workdir, s, log)
    out["conversations"] = _conversations(procs, workdir, s, log)
    out["llama_server"] = _llama(procs, workdir, s, log)
    return out
