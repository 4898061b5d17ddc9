"""(j) Priority classes: people first, bulk work on what is left (SPEC §15).

A fake upstream answers every request after a fixed service time ``service`` (no
streaming); two ``worker.py`` give ``slots`` slots each. Bulk work is a closed loop of
``flex`` requests, three times as many as there are slots, so the queue never runs dry;
an interactive trickle of ``default`` requests arrives at a fixed rate. Measured, one
process and (with Redis) two processes each with one worker, clients spread evenly:

- *flex alone*: the flex goodput (completed requests per second);
- *interactive alone*: the trickle's latency (its baseline);
- *both*: the interactive requests' queue wait (latency minus the service time and the
  baseline's overhead) at p50/p95 against the service time, the flex goodput against
  alone, preemptions, and the work they threw away (each preempted request lost at most
  the service time it had run), and every non-200 answer.

Targets: interactive p95 queue wait <= 10 % of the service time; no client-visible error;
flex goodput >= 85 % of alone.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.cluster import redis_reachable
from bench.procs import Processes
from bench.targets import ROOT, WORKER_SECRET, project_python, start_server, wait_workers

MODEL = "mock-model"
CHAT = "/v1/chat/completions"


def _start_workers(
    procs: Processes, server_url: str, backend_url: str, count: int, slots: int, label: str
) -> None:
    for i in range(count):
        procs.start(
            f"worker-{label}-{i + 1}",
            [
                project_python(),
                "worker.py",
                "--proxy-url",
                server_url,
                "--worker-secret",
                WORKER_SECRET,
                "--backend-url",
                backend_url,
                "--models",
                MODEL,
                "--max-concurrent",
                str(slots),
                "--worker-name",
                f"classes-{label}-{i + 1}",
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
        )


async def _load(urls: list[str], *, seconds: float, flex: int, trickle: float) -> dict[str, Any]:
    """``flex`` closed loops of flex requests and an open-loop trickle of ``trickle``
    default requests per second, for ``seconds``; spread evenly over ``urls``."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + seconds
    done = {"flex": 0}
    errors: list[str] = []
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=flex + 64, max_keepalive_connections=flex + 64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def bulk(index: int) -> None:
            url = urls[index % len(urls)] + CHAT
            body = {"model": MODEL, "service_tier": "flex", "messages": []}
            while loop.time() < stop_at:
                response = await client.post(url, json=body)
                if response.status_code == 200:
                    if loop.time() < stop_at:
                        done["flex"] += 1
                else:
                    errors.append(f"flex {response.status_code}: {response.text[:120]}")

        async def person(index: int) -> None:
            started = loop.time()
            response = await client.post(
                urls[index % len(urls)] + CHAT, json={"model": MODEL, "messages": []}
            )
            if response.status_code == 200:
                latencies.append(loop.time() - started)
            else:
                errors.append(f"default {response.status_code}: {response.text[:120]}")

        tasks = [asyncio.ensure_future(bulk(i)) for i in range(flex)]
        people = []
        if trickle > 0:
            index = 0
            while loop.time() < stop_at:
                people.append(asyncio.ensure_future(person(index)))
                index += 1
                await asyncio.sleep(1 / trickle)
        else:
            await asyncio.sleep(max(0.0, stop_at - loop.time()))
        await asyncio.gather(*tasks, *people)
    return {
        "flex_per_sec": round(done["flex"] / seconds, 2),
        "latencies": latencies,
        "errors": errors,
    }


def _wait_cluster(urls: list[str], timeout: float = 30.0) -> None:
    """Until every process says its cluster state is ok."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [httpx.get(u + "/health", timeout=5).json().get("cluster", {}) for u in urls]
        if all(state.get("state") == "ok" for state in states):
            return
        time.sleep(0.1)
    raise RuntimeError("classes bench: the two processes did not join the cluster")


def _preemptions(urls: list[str]) -> int:
    total = 0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        match = re.search(r"^modelrelay_preemptions_total (\S+)$", text, re.M)
        total += int(float(match.group(1))) if match else 0
    return total


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _measure(urls: list[str], s: dict[str, Any]) -> dict[str, Any]:
    service, seconds = s["j_service"], s["j_seconds"]
    capacity = s["j_slots"] * 2
    alone = asyncio.run(_load(urls, seconds=seconds, flex=3 * capacity, trickle=0))
    baseline = asyncio.run(_load(urls, seconds=seconds, flex=0, trickle=s["j_trickle"]))
    before = _preemptions(urls)
    both = asyncio.run(_load(urls, seconds=seconds, flex=3 * capacity, trickle=s["j_trickle"]))
    preempted = _preemptions(urls) - before
    overhead = statistics.median(baseline["latencies"]) - service if baseline["latencies"] else 0
    waits = [max(0.0, lat - service - overhead) for lat in both["latencies"]]
    goodput = both["flex_per_sec"] / alone["flex_per_sec"] if alone["flex_per_sec"] else 0.0
    thrown = preempted * service  # at most: each had run for less than the service time
    return {
        "service_secs": service,
        "slots": capacity,
        "flex_alone_per_sec": alone["flex_per_sec"],
        "flex_with_people_per_sec": both["flex_per_sec"],
        "flex_goodput_ratio": round(goodput, 3),
        "interactive_requests": len(both["latencies"]),
        "interactive_baseline_p50_ms": round(1000 * _pct(baseline["latencies"], 0.5), 1),
        "interactive_wait_p50_ms": round(1000 * _pct(waits, 0.5), 1),
        "interactive_wait_p95_ms": round(1000 * _pct(waits, 0.95), 1),
        "wait_p95_of_service": round(_pct(waits, 0.95) / service, 3),
        "preemptions": preempted,
        "work_thrown_away_secs_at_most": round(thrown, 2),
        "work_thrown_away_share_at_most": round(
            thrown / (capacity * seconds) if seconds else 0.0, 4
        ),
        "errors": len(alone["errors"]) + len(baseline["errors"]) + len(both["errors"]),
        "error_examples": (alone["errors"] + baseline["errors"] + both["errors"])[:3],
    }


def run(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    """Both layouts; the upstream runs in this process's thread."""
    from tests.upstream import upstream_in_thread

    out: dict[str, Any] = {}
    base_env = {
        "MAX_QUEUE_LEN": "10000",
        "QUEUE_TIMEOUT_SECS": "120",
        "PRIORITY_AGING_SECS": "600",  # no aging within a run: the classes alone
    }
    service = s["j_service"]
    with upstream_in_thread(first_byte_delay=service, total_slots=s["j_slots"]) as up:
        log("  one process, two workers")
        server, url = start_server(procs, workdir, "classes-one", None, "daphne", **base_env)
        _start_workers(procs, url, up.url, 2, s["j_slots"], "one")
        wait_workers(url, 2, server, timeout=60)
        out["one_process"] = _measure([url], s)
        procs.stop_all()
        if not redis_reachable():
            out["two_processes"] = {"skipped": "Redis is not reachable at 127.0.0.1:6379"}
            return out
        log("  two processes, one worker each")
        env = {
            **base_env,
            "REDIS_URL": "redis://127.0.0.1:6379/0",
            "REDIS_PREFIX": f"bench-{secrets.token_hex(4)}",
            "MODELRELAY_SECRET_PEPPER": secrets.token_urlsafe(32),
            "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        }
        a, a_url = start_server(procs, workdir, "classes-a", None, "daphne", **env)
        shared = {**env, "DATABASE_URL": f"sqlite:///{workdir / 'data-classes-a' / 'db.sqlite3'}"}
        b, b_url = start_server(procs, workdir, "classes-b", None, "daphne", **shared)
        _start_workers(procs, a_url, up.url, 1, s["j_slots"], "a")
        _start_workers(procs, b_url, up.url, 1, s["j_slots"], "b")
        wait_workers(a_url, 1, a, timeout=60)
        wait_workers(b_url, 1, b, timeout=60)
        _wait_cluster([a_url, b_url])
        out["two_processes"] = _measure([a_url, b_url], s)
        procs.stop_all()
    return out
