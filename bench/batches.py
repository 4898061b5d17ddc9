"""(i) Batches on idle capacity: what a batch costs interactive users, and what it gets.

A fake upstream with a fixed service time (``--service-time``) behind two ``worker.py``
with a few slots each; one ``manage.py serve`` (daphne). An interactive trickle (one
non-streaming chat completion per second) is measured alone, then a batch of
``lines`` chat completions runs alone, then again with the trickle alongside: the
trickle's p95 against its batch-free baseline, and the batch's throughput alongside
against alone. Measured twice: with the defaults, and with ``BATCH_SPARE_SLOTS=1``.

Then durability: the server is killed (SIGKILL) a third of the way through a batch
and started again on the same database; once the batch completed, its output must
hold each ``custom_id`` exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import percentile
from bench.procs import Proc, Processes
from bench.targets import (
    MODEL,
    ROOT,
    project_python,
    server_env,
    start_server,
    start_workers,
    wait_workers,
)

#: The engine's timings for the run: look for work often enough that a batch's start
#: is not what is measured, and let a killed process's claims lapse soon.
ENGINE = {"BATCH_POLL_SECS": "0.25", "BATCH_CLAIM_SECS": "2", "BATCH_FLUSH_SECS": "0.25"}
VARIANTS = (("default", {}), ("spare slot", {"BATCH_SPARE_SLOTS": "1"}))
CHAT = "/v1/chat/completions"


def batch_input(lines: int, tag: str) -> bytes:
    out = []
    for i in range(lines):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"{tag} {i}"}]}
        line = {"custom_id": f"{tag}-{i}", "method": "POST", "url": CHAT, "body": body}
        out.append(json.dumps(line))
    return ("\n".join(out) + "\n").encode()


class Trickle:
    """One interactive request per second on an absolute schedule, in a thread."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Trickle:
        self._thread.start()
        return self

    def _run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "interactive"}]}
        with httpx.Client(base_url=self.url, timeout=60) as client:
            client.post(CHAT, json=body)  # not measured: the connection and first request
            start = time.monotonic()
            tick = 0
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    response = client.post(CHAT, json=body)
                    ok = response.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.latencies.append(1000 * (time.perf_counter() - t0))
                else:
                    self.errors += 1
                tick += 1
                self._stop.wait(max(0.0, start + tick - time.monotonic()))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=70)
        values = sorted(self.latencies)
        return {
            "n": len(values),
            "errors": self.errors,
            "p50_ms": percentile(values, 50),
            "p95_ms": percentile(values, 95),
        }


def create(client: httpx.Client, lines: int, tag: str) -> str:
    files = {"file": (f"{tag}.jsonl", batch_input(lines, tag), "application/jsonl")}
    uploaded = client.post("/v1/files", files=files, data={"purpose": "batch"})
    uploaded.raise_for_status()
    body = {"input_file_id": uploaded.json()["id"], "endpoint": CHAT, "completion_window": "24h"}
    created = client.post("/v1/batches", json=body)
    created.raise_for_status()
    return str(created.json()["id"])


def wait_done(client: httpx.Client, batch_id: str, timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            batch = client.get(f"/v1/batches/{batch_id}").json()
        except httpx.HTTPError:
            batch = {}
        if batch.get("status") in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.1)
    raise RuntimeError(f"batch {batch_id} did not end in {timeout:.0f} s")


def timed_batch(client: httpx.Client, lines: int, tag: str) -> dict[str, Any]:
    t0 = time.monotonic()
    batch = wait_done(client, create(client, lines, tag))
    secs = time.monotonic() - t0
    counts = batch["request_counts"]
    return {
        "secs": secs,
        "lines_per_sec": counts["completed"] / secs,
        "completed": counts["completed"],
        "status": batch["status"],
    }


def start_stack(
    procs: Processes, workdir: Path, label: str, upstream: str, s: dict[str, Any], **env: str
) -> tuple[Proc, str, list[Proc]]:
    server, url = start_server(procs, workdir, label, None, "daphne", **ENGINE, **env)
    workers = start_workers(procs, url, upstream, 2, label, max_concurrent=s["i_slots"])
    wait_workers(url, 2, server, timeout=60)
    return server, url, workers


def run(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    upstream = procs.start(
        "upstream-batches",
        [project_python(), "-m", "bench.upstream", "--service-time", str(s["i_service"])],
        cwd=ROOT,
    )
    upstream_url = upstream.wait_for_line(r"upstream listening on (http://\S+)", 30).group(1)
    out: dict[str, Any] = {
        "lines": s["i_lines"],
        "slots": 2 * s["i_slots"],
        "service_ms": 1000 * s["i_service"],
        "variants": {},
    }
    for name, env in VARIANTS:
        label = "batches-" + name.replace(" ", "-")
        server, url, workers = start_stack(procs, workdir, label, upstream_url, s, **env)
        try:
            with httpx.Client(base_url=url, timeout=60) as client:
                trickle = Trickle(url).start()
                time.sleep(s["i_baseline"])  # the baseline is a count of one-per-second requests
                baseline = trickle.stop()
                alone = timed_batch(client, s["i_lines"], "alone")
                trickle = Trickle(url).start()
                alongside = timed_batch(client, s["i_lines"], "alongside")
                alongside["interactive"] = trickle.stop()
        finally:
            for proc in (*workers, server):
                procs.stop(proc)
        out["variants"][name] = {"baseline": baseline, "alone": alone, "alongside": alongside}
        log(
            f"  (i) {name:<10} interactive p95 {baseline['p95_ms']:.0f} ms alone, "
            f"{alongside['interactive']['p95_ms']:.0f} ms with the batch; batch "
            f"{alone['lines_per_sec']:.1f} lines/s alone, "
            f"{alongside['lines_per_sec']:.1f} alongside"
        )
    out["kill"] = killed_mid_batch(procs, workdir, upstream_url, s)
    k = out["kill"]
    log(
        f"  (i) SIGKILL at {k['killed_at']}/{k['lines']} lines: after restart "
        f"{k['unique']} custom_ids, {k['duplicates']} twice, {k['missing']} missing"
    )
    procs.stop(upstream)
    return out


def killed_mid_batch(
    procs: Processes, workdir: Path, upstream_url: str, s: dict[str, Any]
) -> dict[str, Any]:
    """SIGKILL the server a third of the way through a batch, start it again on the
    same database and port, and read the output once the batch completed."""
    lines = s["i_lines"]
    server, url, workers = start_stack(procs, workdir, "batches-kill", upstream_url, s)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            batch_id = create(client, lines, "kill")
            while True:
                counts = client.get(f"/v1/batches/{batch_id}").json()["request_counts"]
                if counts["completed"] >= lines // 3:
                    break
                time.sleep(0.05)
            os.kill(server.pid, signal.SIGKILL)
            killed_at = counts["completed"]
            procs.stop(server)  # gone already; forgets it
            t0 = time.monotonic()
            server = procs.start(
                "server-batches-kill-restarted",
                [project_python(), "manage.py", "serve", "--listen", url.removeprefix("http://")],
                env=server_env(workdir / "data-batches-kill", **ENGINE),
                cwd=ROOT,
            )
            server.wait_for_line(r"Listening on (http://\S+)", timeout=90)
            batch = wait_done(client, batch_id)
            resumed = time.monotonic() - t0
            ids: Counter[str] = Counter()
            for key in ("output_file_id", "error_file_id"):
                if batch.get(key):
                    text = client.get(f"/v1/files/{batch[key]}/content").text
                    ids.update(json.loads(line)["custom_id"] for line in text.splitlines())
    finally:
        for proc in (*workers, server):
            procs.stop(proc)
    expected = {f"kill-{i}" for i in range(lines)}
    return {
        "lines": lines,
        "killed_at": killed_at,
        "resumed_secs": resumed,
        "status": batch["status"],
        "output_lines": sum(ids.values()),
        "unique": len(ids),
        "duplicates": sum(1 for count in ids.values() if count > 1),
        "missing": len(expected - set(ids)),
        "exactly_once": set(ids) == expected and all(c == 1 for c in ids.values()),
    }
