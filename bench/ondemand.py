"""(m) Models on demand: the relay decides what is loaded where (SPEC §19).

Real llama-servers in router mode (``--models-dir`` holding copies of the tiny model
under several names, ``--models-max``), built by ``make llama-server``; the same
requests sent three ways, each from a cold start (fresh routers, nothing loaded):

- *relay*: through one daphne and one ``worker.py`` per box, the relay placing models;
- *unmanaged*: the same, with the workers' ``MODEL_STATES=off`` (every model advertised as
  if loaded, as before the extension): the routers load whatever a request names;
- *ideal*: straight to the routers with the best static placement, each request sent
  to a box of the placement that holds its model (each box loads its models when their
  first request comes, from the same cold start).

Loads are counted in the routers' own logs (each ``spawning server instance``), whoever
asked for them. Workloads: two boxes with ``--models-max 1`` and two models, 40 streamed
requests from 2 clients in three orders (alternating, random, shuffled 20/20); the
shuffled order again with ``--no-models-autoload``; 10 concurrent requests for a model
loaded nowhere; three boxes with ``--models-max 2`` and five models of skewed popularity.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.affinity import llama_server
from bench.peers import wait_http
from bench.procs import Proc, Processes, free_port
from bench.targets import ROOT, WORKER_SECRET, project_python, start_server, wait_workers

CHAT = "/v1/chat/completions"
TWO = ["alpha", "beta"]
FIVE = ["m1", "m2", "m3", "m4", "m5"]
#: The skewed workload's popularity (the share of requests naming each of FIVE).
SKEW = [0.40, 0.25, 0.15, 0.12, 0.08]
SPAWN = "spawning server instance with name="
NOT_LOADED = "not loaded"

Box = tuple[str, Proc]


#: About 1,500 tokens of text (the tiny model's vocabulary is a byte a token).
PROMPT = "Summarise what follows in a few words. " + "The quick brown fox jumps. " * 55


def _models_dir(workdir: Path, label: str, names: list[str], model: Path) -> Path:
    folder = workdir / f"models-{label}"
    folder.mkdir()
    for name in names:
        (folder / f"{name}.gguf").symlink_to(model)
    return folder


def _start_routers(
    procs: Processes,
    binary: str,
    folder: Path,
    count: int,
    models_max: int,
    label: str,
    *,
    autoload: bool = True,
) -> list[Box]:
    boxes = []
    for i in range(count):
        port = free_port()
        argv = [
            binary, "--models-dir", str(folder), "--models-max", str(models_max),
            "--host", "127.0.0.1", "--port", str(port), "--threads", "1", "--no-webui",
        ]  # fmt: skip
        if not autoload:
            argv.append("--no-models-autoload")
        proc = procs.start(f"router-{label}-{i + 1}", argv)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/models", proc, timeout=60)
        boxes.append((url, proc))
    return boxes


def _loads(boxes: list[Box]) -> int:
    return sum(proc.log.read_text(errors="replace").count(SPAWN) for _, proc in boxes)


def _start_relay(
    procs: Processes, workdir: Path, boxes: list[Box], label: str, *, managed: bool
) -> str:
    server, url = start_server(procs, workdir, f"m-{label}", None, "daphne")
    for i, (backend, _) in enumerate(boxes):
        procs.start(
            f"worker-m-{label}-{i + 1}",
            [
                project_python(), "worker.py", "--proxy-url", url,
                "--worker-secret", WORKER_SECRET, "--backend-url", backend,
                "--worker-name", f"box-{i + 1}", "--log-level", "warning",
            ],
            env={**os.environ, "MODEL_STATES": "on" if managed else "off"},
            cwd=ROOT,
        )  # fmt: skip
    wait_workers(url, len(boxes), server, timeout=90)
    return url


async def _stream(client: httpx.AsyncClient, url: str, model: str) -> dict[str, Any]:
    """One streamed chat turn: status, time to first content, whether it ended with
    [DONE], and the error text of a refusal."""
    # A prompt of its own (no prefix another request left in the cache) of the size of a
    # chat turn: its first token costs the backend real work, as on a GPU, rather than
    # the few ms of a cached 70-token prompt, which the relay's hop would dwarf.
    prompt = f"{random.getrandbits(64):016x} " + PROMPT
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first: float | None = None
    done = False
    async with client.stream("POST", url + CHAT, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return {"status": response.status_code, "error": text[:300], "ttft": None}
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
            if line.strip() == "data: [DONE]":
                done = True
    return {"status": 200, "ttft": first, "done": done, "error": ""}


async def _drive(
    order: list[str], clients: int, url_of: Callable[[str], str], *, keepalive: bool = True
) -> list[dict[str, Any]]:
    """``order`` sent by ``clients`` clients, each taking the next request when its last
    one ended (so ``clients`` are in flight at a time). Without ``keepalive`` each request
    has a connection of its own: llama-server's router may close an idle one just as a
    client reuses it, a race that is the client's to avoid, not a failed load."""
    results: list[dict[str, Any]] = []
    queue = list(enumerate(order))
    limits = httpx.Limits() if keepalive else httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def loop() -> None:
            while queue:
                _, model = queue.pop(0)
                results.append(await _stream(client, url_of(model), model))

        await asyncio.gather(*(loop() for _ in range(clients)))
    return results


def _summary(results: list[dict[str, Any]], loads: int) -> dict[str, Any]:
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {
        "requests": len(results),
        "loads": loads,
        "errors": sum(1 for r in results if r["status"] != 200),
        "not_loaded": sum(1 for r in results if NOT_LOADED in r.get("error", "")),
        "cut": sum(1 for r in results if r["status"] == 200 and not r.get("done")),
        "ttft_ms": round(1000 * statistics.mean(ttfts), 1) if ttfts else None,
    }


def _orders(count: int, seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    shuffled = [TWO[i % 2] for i in range(count)]
    rng.shuffle(shuffled)
    return {
        "alternating": [TWO[i % 2] for i in range(count)],
        "random": [rng.choice(TWO) for _ in range(count)],
        "shuffled": shuffled,
    }


def _ideal(
    procs: Processes, binary: str, folder: Path, placement: list[list[str]], models_max: int,
    label: str, order: list[str], clients: int,
) -> dict[str, Any]:  # fmt: skip
    """The best static placement: each request straight to a box of the placement that
    holds its model (round-robin where several do), from the same cold start, each box
    loading its models when their first request comes (as the relay's boxes do)."""
    boxes = _start_routers(procs, binary, folder, len(placement), models_max, label)
    holders: dict[str, list[str]] = {}
    for (url, _), models in zip(boxes, placement, strict=True):
        for model in models:
            holders.setdefault(model, []).append(url)
    turn: dict[str, int] = {}

    def url_of(model: str) -> str:
        turn[model] = turn.get(model, -1) + 1
        urls = holders[model]
        return urls[turn[model] % len(urls)]

    results = asyncio.run(_drive(order, clients, url_of, keepalive=False))
    summary = _summary(results, _loads(boxes))
    procs.stop_all()
    return summary


def _through_relay(
    procs: Processes, workdir: Path, binary: str, folder: Path, count: int, models_max: int,
    label: str, order: list[str], clients: int, *, managed: bool, autoload: bool = True,
) -> dict[str, Any]:  # fmt: skip
    boxes = _start_routers(procs, binary, folder, count, models_max, label, autoload=autoload)
    url = _start_relay(procs, workdir, boxes, label, managed=managed)
    _wait_listed(url, set(order))
    results = asyncio.run(_drive(order, clients, lambda _model: url))
    summary = _summary(results, _loads(boxes))
    procs.stop_all()
    return summary


def _wait_listed(url: str, models: set[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
        if models <= listed:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{models - listed} never listed at {url}")


def _burst(procs: Processes, workdir: Path, binary: str, folder: Path) -> dict[str, Any]:
    """10 concurrent requests for a model loaded nowhere, two boxes."""
    boxes = _start_routers(procs, binary, folder, 2, 1, "burst")
    url = _start_relay(procs, workdir, boxes, "burst", managed=True)
    _wait_listed(url, {"alpha"})

    async def burst() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return list(await asyncio.gather(*(_stream(client, url, "alpha") for _ in range(10))))

    summary = _summary(asyncio.run(burst()), _loads(boxes))
    procs.stop_all()
    return summary


def run(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    found = llama_server()
    if isinstance(found, str):
        return {"skipped": found}
    binary, model = found
    count, clients = s["m_requests"], s["m_clients"]
    two = _models_dir(workdir, "two", TWO, model)
    five = _models_dir(workdir, "five", FIVE, model)
    out: dict[str, Any] = {"settings": {"m_requests": count, "m_clients": clients}}
    orders = _orders(count, seed=7)
    for name, order in orders.items():
        log(f"  two boxes, --models-max 1, two models, {name} order")
        row = {
            "ideal": _ideal(
                procs, binary, two, [["alpha"], ["beta"]], 1, f"{name}-ideal", order, clients
            ),
            "relay": _through_relay(
                procs, workdir, binary, two, 2, 1, f"{name}-relay", order, clients, managed=True
            ),
            "unmanaged": _through_relay(
                procs, workdir, binary, two, 2, 1, f"{name}-unmanaged", order, clients,
                managed=False,
            ),
        }  # fmt: skip
        out[name] = row
    log("  --no-models-autoload, shuffled order")
    shuffled = orders["shuffled"]
    out["no_autoload"] = {
        "relay": _through_relay(
            procs, workdir, binary, two, 2, 1, "noauto-relay", shuffled, clients,
            managed=True, autoload=False,
        ),
        "unmanaged": _through_relay(
            procs, workdir, binary, two, 2, 1, "noauto-unmanaged", shuffled, clients,
            managed=False, autoload=False,
        ),
    }  # fmt: skip
    log("  10 concurrent requests for a model loaded nowhere")
    out["burst"] = _burst(procs, workdir, binary, two)
    log("  three boxes, --models-max 2, five models of skewed popularity")
    rng = random.Random(11)
    skewed = rng.choices(FIVE, weights=SKEW, k=s["m_skew_requests"])
    placement = [["m1", "m2"], ["m1", "m3"], ["m4", "m5"]]
    out["skewed"] = {
        "placement": placement,
        "ideal": _ideal(
            procs, binary, five, placement, 2, "skew-ideal", skewed, s["m_skew_clients"]
        ),
        "relay": _through_relay(
            procs, workdir, binary, five, 3, 2, "skew-relay", skewed, s["m_skew_clients"],
            managed=True,
        ),
    }  # fmt: skip
    return out
