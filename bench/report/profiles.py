"""The profiles section: where the server's and worker's CPU went, by layer and function.

Each py-spy sample is attributed to the innermost frame outside the standard library
(``bench/profile.py``), and packages are grouped into layers: for the server, the ASGI
server's (daphne with Twisted and autobahn, or uvicorn with its protocol libraries),
ModelRelay's own code, Django and Channels, and the standard library (asyncio's loop);
for worker.py, its own code, websockets, httpx with httpcore and h11, and the standard
library, in % and in µs of the measured CPU per request or chunk.
"""

from __future__ import annotations

from typing import Any

from bench.report.table import HEADER, RELAYS, num, per, table

#: Layer -> the packages (or top-level modules) it is made of.
LAYERS = {
    "daphne, Twisted, autobahn": (
        "daphne",
        "twisted",
        "autobahn",
        "txaio",
        "zope",
        "automat",
        "hyperlink",
        "constantly",
        "incremental",
        "attr",
    ),
    "uvicorn, websockets, httptools": ("uvicorn", "websockets", "httptools", "h11", "uvloop"),
    "ModelRelay (relay/, modelrelay_site/, workers_app/)": (
        "relay",
        "modelrelay_site",
        "workers_app",
        "worker.py",
        "manage.py",
    ),
    "Django, Channels, asgiref": ("django", "channels", "asgiref"),
    "asyncio and the rest of the stdlib": ("stdlib",),
}
DAPHNE, UVICORN_LAYER, OURS = list(LAYERS)[:3]
OTHER = "other"
#: worker.py's layers.
WORKER_LAYERS = {
    "worker.py's own code (worker.py, relay/worker/, relay/wire/)": ("relay", "worker.py"),
    "websockets": ("websockets",),
    "httpx, httpcore, h11": ("httpx", "httpcore", "h11", "anyio", "sniffio"),
    "asyncio and the rest of the stdlib": ("stdlib",),
}
TITLES = {"a": "(a) non-streaming, 32 connections", "f": "(f) one big box"}


def title(key: str) -> str:
    return TITLES.get(key, f"(c) {key[1:]} streams")


def layers(
    summary: dict[str, Any], groups: dict[str, tuple[str, ...]] = LAYERS
) -> dict[str, float]:
    """% of a profile's samples per layer of ``groups`` (and ``other``)."""
    out = dict.fromkeys([*groups, OTHER], 0.0)
    owner = {pkg: layer for layer, pkgs in groups.items() for pkg in pkgs}
    for pkg, pct in (summary.get("packages") or {}).items():
        out[owner.get(pkg, OTHER)] += pct
    return out


def server_layers(profiles: dict[str, Any]) -> list[tuple[str, str, dict[str, float], int]]:
    """``(target, scenario key, layer shares, samples)`` of every server profile."""
    out = []
    for relay in RELAYS:
        for key, procs in (profiles.get(relay) or {}).items():
            summary = procs.get("server")
            if summary and summary["samples"]:
                out.append((relay, key, layers(summary), summary["samples"]))
    return out


def _layer_table(profiles: dict[str, Any]) -> list[str]:
    found = server_layers(profiles)
    if not found:
        return []
    shown = [
        name for name in [*LAYERS, OTHER] if any(shares[name] >= 0.05 for _, _, shares, _ in found)
    ]
    rows = [
        [HEADER[relay], title(key), str(samples)] + [num(shares[name]) for name in shown]
        for relay, key, shares, samples in found
    ]
    return [
        "**Server process samples by layer**, % (each sample counts for the innermost "
        "frame outside the standard library: the code that asked for the work):",
        "",
        *table(["server", "load", "samples", *shown], rows),
        "",
    ]


def _worker_cost(res: dict[str, Any], relay: str, key: str) -> tuple[float | None, str]:
    """The worker's measured CPU per unit for a profile's load, and the unit."""
    if key == "a":
        return per(res.get("a", {}).get(relay), "workers", "requests"), "request"
    if key == "f":
        run = res.get("f", {}).get(relay)
        return per(run["window"] if run else None, "workers", "chunks"), "chunk"
    return per(res.get("c", {}).get(relay, {}).get(key[1:]), "workers", "chunks"), "chunk"


def _worker_layer_table(profiles: dict[str, Any], res: dict[str, Any]) -> list[str]:
    found = []
    for relay in RELAYS:
        for key, procs in (profiles.get(relay) or {}).items():
            summary = procs.get("worker")
            if summary and summary["samples"]:
                found.append((relay, key, layers(summary, WORKER_LAYERS), summary["samples"]))
    if not found:
        return []
    names = [*WORKER_LAYERS, OTHER]
    rows = []
    for relay, key, shares, samples in found:
        cost, unit = _worker_cost(res, relay, key)
        cells = [
            f"{num(shares[name])} %"
            + (f" ({cost * shares[name] / 100:,.0f} µs)" if cost is not None else "")
            for name in names
        ]
        total = f"{cost:,.0f} µs / {unit}" if cost is not None else "-"
        rows.append([HEADER[relay], title(key), str(samples), total, *cells])
    return [
        "**worker.py: where the time goes**, by layer: % of samples (each counts for the "
        "innermost frame outside the standard library), and that share of the worker's "
        "CPU per request or chunk measured in the same run (samples hold the GIL; the "
        "system time of socket calls, made without it, is spread over the layers). worker.py "
        "runs on uvloop, whose loop is C: its socket writes count for the Python code that "
        "makes them (mostly the worker's own), its polling and reads for the stdlib's "
        "`Runner.run`:",
        "",
        *table(["server", "load", "samples", "worker CPU measured", *names], rows),
        "",
    ]


def profile_lines(
    profiles: dict[str, Any], rows: int = 15, res: dict[str, Any] | None = None
) -> list[str]:
    out = [
        "### Profiles (py-spy, samples holding the GIL, during a separate unmeasured pass)",
        "",
        *_layer_table(profiles),
        *_worker_layer_table(profiles, res or {}),
    ]
    for relay, scenarios in profiles.items():
        for key, procs in scenarios.items():
            for name, prof in procs.items():
                out += [
                    f"**{HEADER.get(relay, relay)}, {title(key)} — {name}** "
                    f"({prof['samples']} samples); top by own time:",
                    "",
                    "| self % | total % | function |",
                    "|---|---|---|",
                ]
                out += [f"| {s:.1f} | {t:.1f} | `{fn}` |" for fn, s, t in prof["self"][:rows]]
                ours = prof.get("ours") or []
                if ours:
                    out += [
                        "",
                        "ModelRelay's own functions, inclusive: "
                        + "; ".join(f"`{fn}` {t:.1f} %" for fn, t in ours),
                    ]
                packages = [(p, s) for p, s in (prof.get("packages") or {}).items() if s >= 0.5]
                if packages:
                    out += [
                        "",
                        "By package (innermost frame outside the stdlib): "
                        + "; ".join(f"{p} {s:.1f} %" for p, s in packages),
                    ]
                out.append("")
    return out
