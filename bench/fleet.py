"""(l) What fleet observability costs (SPEC §17): tracing off and on, and federation.

Usage::

    python bench/fleet.py                  # prints the figures
    python bench/run.py --only l --no-docs # the same inside make bench's report

Measured in this process, on the code the server runs:

- *tracing*: one request through the relay core as the HTTP edge drives it (the edge's
  ``begin``/``admitted`` calls when tracing is on, ``submit``, a worker answering at once,
  the end), CPU µs per request of this process — the SDK's export thread included, and
  the spans flushed to an OTLP/HTTP receiver in another process before the clock stops —
  with tracing off, and on with every request sampled. Off, the hooks are calls on the
  null tracer; their cost is measured by timing exactly those operations;
- *federation*: 100 workers x 1,000 series (llama-server and vLLM shapes, histograms
  included) received, then ``GET /metrics/workers`` rendered: the first scrape (parsing
  every sample) and a steady one (a new sample from every worker each time, as with
  BACKEND_METRICS_SECS equal to the scrape interval), the exposition's size, and the
  memory the samples and their parsed form hold (tracemalloc).

Figures are medians of ``--rounds`` rounds; the load average is printed with them,
since other work on the box inflates every figure. ``make test`` never runs this.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import timeit
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from relay.core.config import ProviderPolicy, RelayConfig  # noqa: E402
from relay.core.keycache import KeyCache, KnownKey  # noqa: E402
from relay.core.relay import Relay  # noqa: E402
from relay.server.federation import Federation  # noqa: E402
from relay.server.tracing import EdgeTracer, NullTracing, Tracing, from_environment  # noqa: E402
from relay.wire import protocol  # noqa: E402

COUNTS = protocol.TokenCounts(prompt_tokens=10, completion_tokens=20)
HEADERS = [
    (b"content-type", b"application/json"),
    (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
]

#: An OTLP/HTTP receiver that accepts every export and does nothing with it (another
#: process, so its CPU is not counted as the relay's).
SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


class _Link:
    def send(self, message: object) -> None:
        pass

    def close(self, code: int, reason: str) -> None:
        pass


async def relay_path(n: int, tracing: EdgeTracer) -> float:
    """CPU µs per request of this process through the core and ``tracing``."""
    config = RelayConfig()
    relay = Relay(config, instance="bench")
    relay.tracer = tracing
    relay.set_provider(ProviderPolicy.from_overrides(config, "local"))
    worker, _ = relay.attach_worker(
        provider="local", name="w", models=["m"], max_concurrent=1, current_load=0, link=_Link()
    )
    start = time.process_time()
    for _ in range(n):
        trace = tracing.begin(HEADERS, "POST", "/v1/chat/completions")
        request = relay.submit(
            model="m",
            endpoint_path="/v1/chat/completions",
            flavor="openai",
            is_streaming=False,
            body='{"model":"m"}',
            headers={},
            key_id=1,
            trace=trace,
        )
        tracing.admitted(trace, request)
        relay.on_complete(
            worker,
            protocol.ResponseComplete(
                request_id=request.id, status_code=200, headers={}, body="{}", token_counts=COUNTS
            ),
        )
    if isinstance(tracing, Tracing):
        tracing.traces.provider.force_flush()
    elapsed = time.process_time() - start
    await relay.aclose()
    return elapsed / n * 1e6


def hook_cost_ns() -> float:
    """ns per request of what the hooks do with tracing off: the edge's calls on the
    null tracer and the core's (``_assign``, ``_finish``), and the two slots a request
    starts with."""

    class Holder:
        __slots__ = ("headers", "trace", "why")

    holder = Holder()
    holder.headers = {}
    tracing = NullTracing()
    request: Any = holder

    def hooks() -> None:
        trace = tracing.begin(HEADERS, "POST", "/v1/chat/completions")
        holder.trace = trace
        holder.why = ""
        tracing.admitted(trace, request)
        tracing.dispatched(request, request, 0.0)
        tracing.finished(request)

    def baseline() -> None:
        pass

    number = 200_000
    best = min(timeit.repeat(hooks, number=number, repeat=7))
    empty = min(timeit.repeat(baseline, number=number, repeat=7))
    return max(0.0, best - empty) / number * 1e9


def start_sink() -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    port = process.stdout.readline().strip()
    return process, f"http://127.0.0.1:{port}"


def tracing_on(endpoint: str, n: int) -> Tracing:

    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": "always_on",
        # Large enough that no span is dropped: every one is exported and counted.
        "OTEL_BSP_MAX_QUEUE_SIZE": str(8 * n + 1000),
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the SDK reads OTEL_BSP_* and the endpoint from os.environ
    try:
        keys = KeyCache("")
        keys.replace({"bench": KnownKey(id=1, key_hash="", name="team-a")})
        tracing = from_environment(env, clock=asyncio.get_running_loop().time, keys=keys)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert isinstance(tracing, Tracing)
    return tracing


async def measure_tracing(n: int, rounds: int) -> dict[str, float]:
    sink, endpoint = start_sink()
    try:
        tracing = tracing_on(endpoint, n)
        off, on = [], []
        await relay_path(min(n, 2000), NullTracing())  # warm up both paths
        await relay_path(min(n, 2000), tracing)
        for _ in range(rounds):  # interleaved, so drifting load hits both alike
            off.append(await relay_path(n, NullTracing()))
            on.append(await relay_path(n, tracing))
        tracing.shutdown()
    finally:
        sink.terminate()
        sink.wait(5)
    off_us = statistics.median(off)
    hooks_ns = hook_cost_ns()
    return {
        "requests": n,
        "off_us": off_us,
        "on_us": statistics.median(on),
        "hooks_off_ns": hooks_ns,
        "hooks_off_share": hooks_ns / 1000 / off_us,
    }


LAGS: list[float] = []


async def loop_lag(tick: float = 0.001) -> float:
    """The longest the event loop was late for a 1 ms timer while this ran (the scrape
    renders in a thread, but holds the GIL while it parses); kept in :data:`LAGS`."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    try:
        while True:
            due = loop.time() + tick
            await asyncio.sleep(tick)
            worst = max(worst, (loop.time() - due) * 1e3)
    finally:
        LAGS.append(worst)


def worker_sample(worker: int, series: int) -> str:
    """About ``series`` sample lines a worker's backend might expose (vLLM-like)."""
    lines = []
    families = 0
    while len([x for x in lines if not x.startswith("#")]) < series:
        name = f"vllm:metric_{families}"
        if families % 4 == 0:  # a histogram: 10 buckets, sum, count
            lines += [f"# HELP {name} Latency.", f"# TYPE {name} histogram"]
            for le in ("0.01", "0.05", "0.1", "0.5", "1", "2.5", "5", "10", "30", "+Inf"):
                lines.append(f'{name}_bucket{{le="{le}",model_name="m{worker}"}} {worker + 3}')
            lines += [
                f'{name}_sum{{model_name="m{worker}"}} 1.5',
                f'{name}_count{{model_name="m{worker}"}} 3',
            ]
        else:
            lines += [f"# HELP {name} A gauge.", f"# TYPE {name} gauge"]
            for engine in range(4):
                lines.append(f'{name}{{engine="{engine}",model_name="m{worker}"}} {worker}.5')
        families += 1
    return "\n".join(lines) + "\n"


async def scrape(fed: Federation) -> tuple[float, float, float]:
    """One scrape: wall ms, this process's CPU ms, and how late the event loop ran (ms)."""
    started, cpu = time.perf_counter(), time.process_time()
    lag = asyncio.get_running_loop().create_task(loop_lag())
    _, refused = await fed.render()
    wall, used = (time.perf_counter() - started) * 1e3, (time.process_time() - cpu) * 1e3
    lag.cancel()
    await asyncio.wait([lag])
    assert refused == []
    return wall, used, LAGS[-1]


def resend(fed: Federation, samples: list[str]) -> None:
    """Every worker sends a new sample (the clock moved on: none is too early)."""
    for w, text in enumerate(samples):
        fed.samples.pop(f"w-{w}", None)
        fed.receive(f"w-{w}", f"box-{w}", "local", protocol.MetricsSample(text=text))


async def federation_once(workers: int, series: int) -> dict[str, float]:
    samples = [worker_sample(w, series) for w in range(workers)]
    fed = Federation(max_bytes=64 << 20, max_series=series * 2)
    try:
        cpu = time.process_time()
        resend(fed, samples)
        receive_us = (time.process_time() - cpu) / workers * 1e6
        first = await scrape(fed)  # starts the rendering process, parses everything
        resend(fed, [text.replace(" 1.5", " 2.5") for text in samples])  # new values
        steady = await scrape(fed)
        cached = await scrape(fed)  # nothing new: render only
        body, _ = await fed.render()
    finally:
        fed.close()
    # The same scrape in a thread of the server process, for comparison.
    threaded = Federation(max_bytes=64 << 20, max_series=series * 2, in_process=True)
    resend(threaded, samples)
    await threaded.render()
    resend(threaded, [text.replace(" 1.5", " 2.5") for text in samples])
    thread_steady = await scrape(threaded)
    # Memory of the parsed samples (what the rendering process holds), in a pass of its
    # own: tracing allocations slows everything down.
    held_fed = Federation(max_bytes=64 << 20, max_series=series * 2, in_process=True)
    tracemalloc.start()
    resend(held_fed, samples)
    await held_fed.render()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "receive_us_per_sample": receive_us,
        "first_scrape_ms": first[0],
        "steady_scrape_ms": steady[0],
        "steady_scrape_cpu_ms": steady[1],
        "loop_lag_max_ms": steady[2],
        "cached_scrape_ms": cached[0],
        "thread_steady_scrape_ms": thread_steady[0],
        "thread_loop_lag_max_ms": thread_steady[2],
        "exposition_bytes": len(body),
        "held_mb": held / 2**20,
        "peak_mb": peak / 2**20,
        "series": body.count(b"\n") - body.count(b"\n#"),
    }


async def measure_federation(workers: int, series: int, rounds: int) -> dict[str, float]:
    runs = [await federation_once(workers, series) for _ in range(rounds)]
    out = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    out.update(workers=workers, series_per_worker=series)
    return out


async def measure(n: int, rounds: int, workers: int, series: int) -> dict[str, Any]:
    return {
        "tracing": await measure_tracing(n, rounds),
        "federation": await measure_federation(workers, series, max(1, rounds // 2)),
        "load_average": os.getloadavg()[0],
    }


def run(settings: dict[str, Any], log: Any) -> dict[str, Any]:
    """Scenario (l) of ``bench/run.py``."""
    result = asyncio.run(
        measure(
            settings["l_requests"],
            settings["l_rounds"],
            settings["l_workers"],
            settings["l_series"],
        )
    )
    t, f = result["tracing"], result["federation"]
    log(
        f"  tracing off {t['off_us']:.1f} µs, on {t['on_us']:.1f} µs per request; "
        f"federation first scrape {f['first_scrape_ms']:.0f} ms"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--series", type=int, default=1_000)
    args = parser.parse_args()
    figures = asyncio.run(measure(args.n, args.rounds, args.workers, args.series))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average {load}")
    for part, values in figures.items():
        if isinstance(values, dict):
            for key, value in values.items():
                print(
                    f"{part}.{key}: {value:.4g}"
                    if isinstance(value, float)
                    else f"{part}.{key}: {value}"
                )


if __name__ == "__main__":
    main()
