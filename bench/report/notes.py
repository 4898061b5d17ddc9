"""The notes under the tables: caveats read off the CPU figures, and daphne against uvicorn.

Caveats: windows perturbed by other processes, and windows where the machine (or the
rig's cores) was saturated, so the figure is the benchmark machine's limit rather than
the target's. The server comparison puts the two ModelRelay deployments side by side
with the profile of the same run, to say where daphne is the limit and where it is not.
"""

from __future__ import annotations

from typing import Any

from bench.report.goals import goals
from bench.report.profiles import DAPHNE, OURS, UVICORN_LAYER, layers
from bench.report.table import DEFAULT, RELAYS, RIG, UVICORN, num, per, share


def caveats(res: dict[str, Any]) -> list[str]:
    """Perturbed windows and saturated rigs or machines."""
    out = []
    st = res["settings"]
    for scen in ("a", "c"):
        for t, runs in res.get(scen, {}).items():
            items = runs.items() if scen == "c" else [("", runs)]
            for k, r in items:
                where = f"({scen}) {t}" + (f" K={k}" if k else "")
                other = share(r, ("other",))
                if other >= 15:
                    out.append(
                        f"{where}: processes outside the benchmark used {other:.0f} % of a core "
                        "during this measurement; the figure may be perturbed."
                    )
                note = _saturated(r, st, where)
                if note is None:
                    continue
                per_unit = per(r, "server", "requests" if scen == "a" else "chunks")
                if t in RELAYS and per_unit:
                    unit = "req/s" if scen == "a" else "chunks/s"
                    note += (
                        f"; the server process used {share(r, ('server',)):.0f} % of a core, "
                        f"and at {per_unit:.0f} µs per {'request' if scen == 'a' else 'chunk'} "
                        f"one fully busy core would relay about {1e6 / per_unit:,.0f} {unit}"
                    )
                out.append(note + ".")
    return out


def _shares(run: dict[str, Any]) -> dict[str, float]:
    wall = run.get("wall") or 0
    return {n: 100 * c / wall for n, c in run.get("cpu", {}).items() if wall}


def _saturated(run: dict[str, Any], st: dict[str, Any], where: str) -> str | None:
    """Why the window's figure is the machine's limit, or ``None`` when it is not."""
    shares = _shares(run)
    busiest = max((n for n in shares if n != "other"), key=lambda n: shares[n])
    if st["pin"]:
        rig = share(run, RIG)
        if rig < 90 * st["rig_cores"]:
            return None
        note = f"{where}: the rig core(s) were {rig:.0f} % busy"
    else:
        total = sum(shares.values())
        if total < 90 * st["cores"]:
            return None
        note = f"{where}: the machine's {st['cores']} cores were {total:.0f} % busy"
    return note + (
        f" (busiest: {busiest}, {shares[busiest]:.0f} % of a core), so this figure "
        "is bounded by the CPU of the benchmark machine"
    )


def notes(res: dict[str, Any]) -> list[str]:
    return caveats(res) + servers(res)


def servers(res: dict[str, Any]) -> list[str]:
    """daphne against uvicorn, same relay code and workers, with the same run's profiles."""
    a, c = res.get("a", {}), res.get("c", {})
    if not (DEFAULT in a and UVICORN in a) and not (DEFAULT in c and UVICORN in c):
        return []
    out = []
    flips = [
        goal
        for (goal, _, met_d), (_, _, met_u) in zip(
            goals(res, DEFAULT), goals(res, UVICORN), strict=True
        )
        if met_d is False and met_u is True
    ]
    if flips:
        out.append(
            "Targets missed under daphne and met under uvicorn, with the same relay code, "
            "workers and settings: " + "; ".join(flips) + "."
        )
    profiles = res.get("profiles") or {}
    k = "250" if "250" in c.get(DEFAULT, {}) else max(c.get(DEFAULT, {"0": 0}), key=int)
    for scen, runs, unit, count_key in (
        ("a", {r: a.get(r) for r in RELAYS}, "request", "requests"),
        (f"c{k}", {r: c.get(r, {}).get(k) for r in RELAYS}, "chunk", "chunks"),
    ):
        if runs[DEFAULT] and runs[UVICORN]:
            out.append(_cost(scen, runs, unit, count_key, profiles))
    if DEFAULT in a and UVICORN in a:
        out.append(_throughput(a, res["settings"]))
    if DEFAULT in c and UVICORN in c:
        out.append(_streaming(c))
    return out


def _server_layers(profiles: dict[str, Any], relay: str, key: str) -> dict[str, float] | None:
    summary = (profiles.get(relay) or {}).get(key, {}).get("server")
    return layers(summary) if summary and summary["samples"] else None


def _cost(
    key: str,
    runs: dict[str, Any],
    unit: str,
    count_key: str,
    profiles: dict[str, Any],
) -> str:
    """Server CPU per request or chunk under both servers, split by the profile's layers."""
    d = per(runs[DEFAULT], "server", count_key) or 0.0
    u = per(runs[UVICORN], "server", count_key) or 0.0
    where = "(a)" if key == "a" else f"(c) K={key[1:]}"
    text = (
        f"{where} server CPU per relayed {unit}: {d:.0f} µs under daphne, {u:.0f} µs under "
        f"uvicorn ({num(d / u if u else None, 1)}x), same relay code and workers."
    )
    ld, lu = _server_layers(profiles, DEFAULT, key), _server_layers(profiles, UVICORN, key)
    if ld is None or lu is None:
        return text + " (No profile in this run: `--profile` gives the split by layer.)"
    text += (
        f" Profile of the same load in this run: {ld[DAPHNE]:.0f} % of the daphne server's "
        f"samples were in daphne, Twisted and autobahn and {ld[OURS]:.0f} % in ModelRelay's "
        f"code (about {d * ld[DAPHNE] / 100:.0f} µs and {d * ld[OURS] / 100:.0f} µs per "
        f"{unit}); under uvicorn, {lu[UVICORN_LAYER]:.0f} % were in uvicorn, websockets and "
        f"httptools and {lu[OURS]:.0f} % in ModelRelay's code (about "
        f"{u * lu[UVICORN_LAYER] / 100:.0f} µs and {u * lu[OURS] / 100:.0f} µs)."
    )
    if d > 1.2 * u and ld[DAPHNE] >= max(ld.values()):
        text += (
            f" **daphne is the limit here**: daphne, Twisted and autobahn are the largest "
            f"part of the server's CPU per {unit}, {ld[DAPHNE] / max(ld[OURS], 0.1):.1f}x the "
            f"relay code's, and the same code under uvicorn needs {100 * (1 - u / d):.0f} % "
            "less CPU."
        )
    else:
        text += " daphne is not what limits the server's CPU cost here."
    return text


def _throughput(a: dict[str, Any], st: dict[str, Any]) -> str:
    d, u = a[DEFAULT], a[UVICORN]
    sd, su = share(d, ("server",)), share(u, ("server",))
    wd, wu = share(d, ("workers",)), share(u, ("workers",))
    text = (
        f"(a) req/s: {d['rps']:,.0f} under daphne, {u['rps']:,.0f} under uvicorn; the server "
        f"process used {sd:.0f} % and {su:.0f} % of a core, worker.py {wd:.0f} % and {wu:.0f} %."
    )
    saturated = [r for r in (d, u) if _saturated(r, st, "") is not None]
    if sd >= 90:
        text += (
            " The daphne server process was saturated: in this window daphne is the "
            "throughput limit."
        )
    elif saturated:
        text += (
            " Neither server process was the bottleneck here but the benchmark machine's "
            "CPU, mostly worker.py (which runs on the GPU boxes in a deployment): req/s is "
            "the machine's limit, not daphne's. The server's own limit is its CPU per request:"
        )
        pd, pu = per(d, "server", "requests"), per(u, "server", "requests")
        if pd and pu:
            text += (
                f" one fully busy core would relay about {1e6 / pd:,.0f} req/s under daphne "
                f"and {1e6 / pu:,.0f} req/s under uvicorn."
            )
    return text


def _streaming(c: dict[str, Any]) -> str:
    parts = []
    for k in sorted(set(c[DEFAULT]) & set(c[UVICORN]), key=int):
        d, u = c[DEFAULT][k], c[UVICORN][k]
        parts.append(
            f"K={k} {d['delay_p99_ms']:,.1f} ms vs {u['delay_p99_ms']:,.1f} ms "
            f"(server {share(d, ('server',)):.0f} % vs {share(u, ('server',)):.0f} % of a core)"
        )
    return "(c) p99 chunk delay, daphne vs uvicorn: " + "; ".join(parts) + "."
