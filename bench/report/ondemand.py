"""(m) Models on demand: what the relay loads where, against the best static placement."""

from __future__ import annotations

from typing import Any

from bench.report.table import table

#: Targets (issue text): model loads at most the ideal placement's + 1 on the two-model
#: workload and 1.5x ideal on the skewed one; mean first-token time at most 1.2x the
#: ideal's; one load and no error for 10 concurrent requests for a model loaded nowhere;
#: no request failed with "not loaded" without autoload; no stream cut by the relay.
PLUS_ONE = 1
SKEW_RATIO = 1.5
TTFT_RATIO = 1.2


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _row(label: str, r: dict[str, Any]) -> list[str]:
    ttft = "-" if r["ttft_ms"] is None else f"{r['ttft_ms']:.0f}"
    return [
        label, str(r["requests"]), str(r["loads"]), str(r["errors"]), str(r["not_loaded"]),
        str(r["cut"]), ttft,
    ]  # fmt: skip


HEAD = ["", "requests", "model loads", "errors", "'not loaded'", "streams cut", "mean TTFT ms"]


def ondemand(res: dict[str, Any]) -> list[str]:
    m = res.get("ondemand")
    if not m:
        return []
    lines = ["### (m) Models on demand — the relay decides what is loaded where", ""]
    if "skipped" in m:
        return [*lines, f"Skipped: {m['skipped']}.", ""]
    s = m["settings"]
    lines += [
        "`bench/ondemand.py`: real llama-servers in router mode (`make llama-server`; "
        "`--models-dir` holding copies of the tiny random-weight model under several names), "
        "each run from a cold start. *relay*: through one daphne and one `worker.py` per box, "
        "the relay placing models; *unmanaged*: the same with the workers' `MODEL_STATES=off` "
        "(every model advertised as loaded, the routers load what requests name); *ideal*: "
        "straight to the routers with the best static placement, each request to a box that "
        "holds its model, each box loading its models on their first request. Loads are "
        "counted in the routers' logs, whoever caused them. "
        f"{s['m_requests']} streamed requests from {s['m_clients']} clients, each with a "
        "prompt of about 1,500 tokens of its own (no prefix cached by another), so that its "
        "first token is backend work, as on a GPU; the relay's own added latency is (a)'s.",
        "",
    ]
    rows = []
    verdicts = []
    for order in ("alternating", "random", "shuffled"):
        row = m[order]
        ideal, relay = row["ideal"], row["relay"]
        rows += [
            _row(f"{order}: ideal", ideal),
            _row(f"{order}: relay", relay),
            _row(f"{order}: unmanaged", row["unmanaged"]),
        ]
        loads_ok = relay["loads"] <= ideal["loads"] + PLUS_ONE
        ttft_ok = (
            relay["ttft_ms"] is not None
            and ideal["ttft_ms"] is not None
            and relay["ttft_ms"] <= TTFT_RATIO * ideal["ttft_ms"]
        )
        verdicts.append(
            f"- {order}: loads {relay['loads']} against ideal {ideal['loads']} + {PLUS_ONE}: "
            f"{_met(loads_ok)}; mean TTFT {relay['ttft_ms']} ms against "
            f"{TTFT_RATIO} x {ideal['ttft_ms']} ms: {_met(ttft_ok)}; errors {relay['errors']}, "
            f"streams cut {relay['cut']}: {_met(relay['errors'] == 0 and relay['cut'] == 0)}"
        )
    noauto = m["no_autoload"]
    rows += [
        _row("no autoload: relay", noauto["relay"]),
        _row("no autoload: unmanaged", noauto["unmanaged"]),
        _row("10 at once, cold: relay", m["burst"]),
    ]
    skew = m["skewed"]
    rows += [_row("skewed: ideal", skew["ideal"]), _row("skewed: relay", skew["relay"])]
    lines += table(HEAD, rows)
    burst = m["burst"]
    ideal, relay = skew["ideal"], skew["relay"]
    skew_ttft_ok = (
        relay["ttft_ms"] is not None
        and ideal["ttft_ms"] is not None
        and relay["ttft_ms"] <= TTFT_RATIO * ideal["ttft_ms"]
    )
    cut = sum(m[o]["relay"]["cut"] for o in ("alternating", "random", "shuffled")) + relay["cut"]
    verdicts += [
        f"- `--no-models-autoload`: {noauto['relay']['not_loaded']} requests failed with "
        f"'not loaded' (unmanaged: {noauto['unmanaged']['not_loaded']}): "
        f"{_met(noauto['relay']['not_loaded'] == 0)}",
        f"- 10 concurrent requests for a model loaded nowhere: {burst['loads']} load(s), "
        f"{burst['errors']} errors: {_met(burst['loads'] == 1 and burst['errors'] == 0)}",
        f"- skewed (3 boxes, `--models-max 2`, 5 models, placement {skew['placement']}): "
        f"loads {relay['loads']} against {SKEW_RATIO} x ideal {ideal['loads']}: "
        f"{_met(relay['loads'] <= SKEW_RATIO * ideal['loads'])}; mean TTFT "
        f"{relay['ttft_ms']} ms against {TTFT_RATIO} x {ideal['ttft_ms']} ms: "
        f"{_met(skew_ttft_ok)}",
        f"- streams cut by a relay-initiated unload: {cut}: {_met(cut == 0)}",
    ]
    return [*lines, "", *verdicts, ""]
