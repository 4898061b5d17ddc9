"""(o) Streams that survive a dropped connection (SPEC §18)."""

from __future__ import annotations

from typing import Any

from bench.report.table import table

#: Target: the first replayed byte through another process, after the reattach.
FIRST_BYTE_MS = 100.0


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def resume(res: dict[str, Any]) -> list[str]:
    o = res.get("resume")
    if not o:
        return []
    lines = ["### (o) Streams that survive a dropped connection", ""]
    rows = []
    targets = []
    for label, key in (("one process", "one_process"), ("another process", "two_processes")):
        r = o.get(key)
        if r is None:
            continue
        if "skipped" in r:
            lines.append(f"- {label}: not run ({r['skipped']})")
            continue
        b = r["background"]
        identical = r.get("all_identical", b["identical"])
        requests = r.get("backend_requests", [b["backend_requests"]])
        first = (
            f"{r['first_byte_ms_median']:.1f} / {r['first_byte_ms_max']:.1f} ms "
            f"({r['reattaches']} reattaches)"
            if "reattaches" in r
            else f"{b['first_byte_ms']:.1f} ms"
        )
        rows.append(
            [
                label,
                f"{b['events']} events, dropped after {b['dropped_at']}",
                _yes(identical and b["sequence_ok"] and b["text_ok"]),
                ", ".join(str(n) for n in requests),
                first,
                f"{r['replay']['bytes']} bytes, dropped at {r['replay']['dropped_at_byte']}: "
                + ("identical" if r["replay"]["identical"] else "**different**"),
            ]
        )
        targets += [
            [
                f"{label}: events after the reattach = an uninterrupted run's (text, numbers)",
                _yes(identical),
                _met(identical),
            ],
            [
                f"{label}: the backend received exactly one request",
                ", ".join(str(n) for n in requests),
                _met(all(n == 1 for n in requests)),
            ],
            [
                f"{label}: llama.cpp protocol, resumed at a random byte, byte-identical",
                _yes(r["replay"]["identical"]),
                _met(r["replay"]["identical"]),
            ],
        ]
        if "reattaches" in r:
            targets.append(
                [
                    f"{label}: first replayed byte ≤ {FIRST_BYTE_MS:.0f} ms after the reattach",
                    f"{r['first_byte_ms_max']:.1f} ms (max)",
                    _met(r["first_byte_ms_max"] <= FIRST_BYTE_MS),
                ]
            )
    m = o.get("memory")
    if m:
        targets.append(
            [
                f"memory: {m['responses']} retained responses of {m['kib_each']} KiB "
                f"({m['asked_mib']:.0f} MiB asked) within STREAM_RETAIN_TOTAL_BYTES = "
                f"{m['bound_mib']} MiB",
                f"{m['held_mib']:.1f} MiB held ({m['retained']} kept, {m['evicted']} emptied); "
                f"RSS +{m['rss_growth_mib']:.1f} MiB (with what the allocator keeps of "
                "the records it freed)",
                _met(m["within_bound"]),
            ]
        )
    c = o.get("cost")
    if c:
        lines_cost = [
            f"Server CPU per streamed chunk, in process (`bench/stream_edge.py`, "
            f"{c['streams']} streams of {c['chunks_per_stream']} chunks, load average "
            f"{c['load_average']}): a stream that asks for nothing "
            f"**{c['plain_us_per_chunk']:.1f} µs**; the same chunks through a resumable "
            f"response's pump and log, one reader: {c['resumable_us_per_chunk']:.1f} µs.",
            "",
        ]
    else:
        lines_cost = []
    if rows:
        lines += [
            "`bench/resume.py`: daphne, one `worker.py`, the tests' fake upstream streaming "
            "Responses events and chat chunks. A background stream (`background: true, "
            "stream: true`) is read to an event and dropped, then reattached with "
            "`GET /v1/responses/{id}?stream=true&starting_after=N` (through the same process, "
            "or through a second process sharing Redis, the worker connected to the first); "
            "a chat stream with `X-Conversation-Id` is dropped at a random byte and resumed "
            "with `GET /v1/stream/{id}?from=N`. First byte: from sending the reattach to its "
            "first body byte, while the response still runs.",
            "",
            *table(
                [
                    "layout",
                    "background stream",
                    "same events?",
                    "backend requests",
                    "first byte (median / max)",
                    "llama.cpp protocol",
                ],
                rows,
            ),
            "",
        ]
    lines += lines_cost
    if targets:
        lines += [*table(["target", "measured", "met?"], targets), ""]
    return lines
