"""(n) Speed-aware routing: predicted time to first token against least load, deadlines,
hedged stalls, and what it costs per request."""

from __future__ import annotations

from typing import Any

from bench.report.table import table

#: Targets (issue text): on the mixed pools mean TTFT at least 30 % and p95 at least 40 %
#: lower than least-load's; within 5 % of it on identical workers; with deadlines at
#: least-load's p90, 95 % of admitted requests meet theirs, the impossible ones refused
#: within 50 ms; hedging a box that stalls 1 request in 20: p99 of priority streams at
#: least 50 % lower for at most 5 % more backend requests; routing at most 10 µs more per
#: request than today's.
MEAN_CUT = 0.30
P95_CUT = 0.40
SAME_BAND = 0.05
DEADLINE_MET = 0.95
REFUSAL_MS = 50.0
P99_CUT = 0.50
EXTRA_SHARE = 0.05
EXTRA_US = 10.0


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _cut(before: float | None, after: float | None) -> float | None:
    if not before or after is None:
        return None
    return 1.0 - after / before


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f} %" if x < 0 else f"{100 * x:.0f} %"


def _lower(x: float | None) -> str:
    """A cut as words: "12 % lower", or "12 % higher" when it went up."""
    if x is None:
        return "-"
    return f"{100 * x:.0f} % lower" if x >= 0 else f"{-100 * x:.0f} % higher"


def speeds(res: dict[str, Any]) -> list[str]:
    n = res.get("speeds")
    if not n:
        return []
    s = n["settings"]
    lines = [
        "### (n) Speed-aware routing — mixed boxes, deadlines, hedged stalls",
        "",
        "`bench/speeds.py`: each box's backend is a fake (`tests/cacheupstream.py`) that "
        f"processes one prompt at a time at {s['n_cost_us']:.0f} µs a prompt token and "
        f"streams its {s['n_reply_tokens']}-token reply at {s['n_decode_ms']:.0f} ms a token, "
        "both divided by its speed; one `worker.py` per box "
        f"(`--max-concurrent {s['n_slots']}`), one daphne per policy. Open-loop Poisson "
        f"arrivals keeping the pool {100 * s['n_load']:.0f} % busy, 70 % short prompts "
        f"({s['n_short_bytes']} bytes) and 30 % long ones ({s['n_long_bytes']} bytes), every "
        f"prompt new; {s['n_rounds']} round(s) of {s['n_seconds']:.0f} s per policy, "
        "alternating, the same schedules, after an unmeasured warm-up of "
        f"{s['n_warmup']} requests. Time to first token is to the first byte of the stream.",
        "",
    ]
    rows = []
    verdicts = []
    pools = n["pools"]
    for name, row in pools.items():
        least, predicted = row["least_load"], row["predicted"]
        for policy, r in (("least_load", least), ("predicted", predicted)):
            rows.append(
                [
                    f"{name} {row['speeds']}, {100 * row['load']:.0f} %",
                    policy,
                    str(r["requests"]),
                    str(r["errors"]),
                    f"{r['mean_ttft_ms']}",
                    f"{r['p95_ttft_ms']}",
                    " / ".join(f"{100 * x:.0f} %" for x in r["share_by_box"]),
                ]
            )
        mean_cut = _cut(least["mean_ttft_ms"], predicted["mean_ttft_ms"])
        p95_cut = _cut(least["p95_ttft_ms"], predicted["p95_ttft_ms"])
        if name.endswith("_heavy"):
            verdicts.append(
                f"- {name} ({100 * row['load']:.0f} % busy, not judged): mean TTFT "
                f"{_lower(mean_cut)}, p95 {_lower(p95_cut)} than least-load"
            )
        elif name.startswith("mixed"):
            verdicts += [
                f"- {name}: mean TTFT {_pct(mean_cut)} lower than least-load (≥ "
                f"{100 * MEAN_CUT:.0f} %): {_met(mean_cut is not None and mean_cut >= MEAN_CUT)}",
                f"- {name}: p95 TTFT {_pct(p95_cut)} lower (≥ {100 * P95_CUT:.0f} %): "
                f"{_met(p95_cut is not None and p95_cut >= P95_CUT)}",
            ]
        else:
            within = mean_cut is not None and abs(mean_cut) <= SAME_BAND
            faster = (
                ""
                if within or not mean_cut or mean_cut < 0
                else (
                    " (faster, outside the band on the good side: a prediction counts the "
                    "prompt tokens waiting on each box, least load only the requests)"
                )
            )
            verdicts.append(
                f"- {name}: mean TTFT {_pct(mean_cut)} lower than least-load (within ±"
                f"{100 * SAME_BAND:.0f} %): {_met(within)}{faster}; p95 {_lower(p95_cut)}"
            )
        learned = ", ".join(
            f"{k} {v:,.0f}" for k, v in sorted(row["learned_prefill_tokens_per_sec"].items())
        )
        verdicts.append(
            f"  - learned prefill tokens/s: {learned} (the fakes': "
            f"{', '.join(f'{v:,}' for v in row['true_prefill_tokens_per_sec'])})"
        )
    head = [
        "pool (speeds, busy)",
        "routing",
        "requests",
        "errors",
        "mean TTFT ms",
        "p95 ms",
        "share by box",
    ]
    lines += table(head, rows)
    lines += ["", *verdicts, ""]
    deadline = pools.get("mixed_2", {}).get("deadlines")
    if deadline:
        share = deadline["met_share"]
        refusal = deadline["refusal_ms_max"]
        lines += [
            f"Deadlines (mixed_2, `predicted`): every request states `X-Deadline-Ms: "
            f"{deadline['deadline_ms']}` (least-load's p90 above), one in ten 20 ms (impossible): "
            f"{deadline['requests']} requests, {deadline['admitted']} admitted, "
            f"{deadline['refused']} refused ({deadline['refused_impossible']} of them impossible "
            f"ones), other errors {deadline['other_errors']}.",
            "",
            f"- admitted requests that met their deadline: {deadline['met']} of "
            f"{deadline['admitted']} ({_pct(share)}; ≥ {100 * DEADLINE_MET:.0f} %): "
            f"{_met(share is not None and share >= DEADLINE_MET)}",
            f"- refused at once: slowest refusal {refusal} ms, median "
            f"{deadline['refusal_ms_p50']} ms (≤ {REFUSAL_MS:.0f} ms): "
            f"{_met(refusal is not None and refusal <= REFUSAL_MS)}",
            "",
        ]
    hedging = n.get("hedging")
    if hedging:
        off, on = hedging["off"], hedging["on"]
        cut = _cut(off["p99_ttft_ms"], on["p99_ttft_ms"])
        extra = on["extra_backend_share"]
        lines += [
            f"Hedging: two identical boxes, one holding 1 request in {hedging['stall_every']} for "
            f"{hedging['stall_secs']} s before its first byte; `priority` streams of short "
            f"prompts, HEDGE_MAX_SHARE 0 and {s['n_hedge_share']}, the same schedule.",
            "",
        ]
        head = ["hedging", "requests", "errors", "mean TTFT ms", "p95 ms", "p99 ms"]
        head += ["backend requests", "stalled", "hedges sent / won"]
        hedge_rows = []
        for mode, r in (("off", off), ("on", on)):
            sent_won = f"{r['hedges'].get('sent', 0)} / {r['hedges'].get('won', 0)}"
            hedge_rows.append(
                [
                    mode, str(r["requests"]), str(r["errors"]), f"{r['mean_ttft_ms']}",
                    f"{r['p95_ttft_ms']}", f"{r['p99_ttft_ms']}", str(r["backend_requests"]),
                    str(r["stalled"]), sent_won,
                ]
            )  # fmt: skip
        lines += table(head, hedge_rows)
        lines += [
            "",
            f"- p99 TTFT {_pct(cut)} lower with hedging (≥ {100 * P99_CUT:.0f} %): "
            f"{_met(cut is not None and cut >= P99_CUT)}",
            f"- extra backend requests {100 * extra:.1f} % (≤ {100 * EXTRA_SHARE:.0f} %): "
            f"{_met(extra <= EXTRA_SHARE)}",
            "",
        ]
    conversations = n.get("conversations")
    if conversations:
        aware, predicted = conversations["cache_aware"], conversations["predicted"]
        lines += [
            "Conversations ((k)'s workload: agent-shaped conversations of "
            f"{s.get('k_turns', 8)} streamed turns on two identical boxes whose fakes keep a "
            "prompt cache):",
            "",
        ]
        lines += table(
            ["routing", "turns", "prompt tokens / turn", "recomputed / turn", "mean TTFT ms"],
            [
                [p, str(r["turns"]), str(r["prompt_tokens_per_turn"]),
                 str(r["recomputed_per_turn"]), str(r["ttft_ms"])]
                for p, r in (("cache_aware", aware), ("predicted", predicted))
            ],
        )  # fmt: skip
        lines.append("")
    llama = n.get("llama_server")
    if llama and "skipped" not in llama:
        least, predicted = llama["least_load"], llama["predicted"]
        learned = ", ".join(
            f"{k} {v:,.0f}" for k, v in sorted(llama["learned_prefill_tokens_per_sec"].items())
        )
        lines += [
            "Real llama-servers (`make llama-server`'s tiny random-weight model, one token a "
            f"byte): two, one with {llama['threads'][0]} thread and one with "
            f"{llama['threads'][1]}, {llama['slots']} slots each; the same workload shape "
            f"({s['n_llama_short_bytes']}- and {s['n_llama_long_bytes']}-byte prompts), "
            f"{s['n_llama_seconds']:.0f} s per policy. Learned prefill tokens/s: {learned}.",
            "",
        ]
        lines += table(
            ["routing", "requests", "errors", "mean TTFT ms", "p95 ms"],
            [
                [p, str(r["requests"]), str(r["errors"]), str(r["mean_ttft_ms"]),
                 str(r["p95_ttft_ms"])]
                for p, r in (("least_load", least), ("predicted", predicted))
            ],
        )  # fmt: skip
        mean_cut = _cut(least["mean_ttft_ms"], predicted["mean_ttft_ms"])
        p95_cut = _cut(least["p95_ttft_ms"], predicted["p95_ttft_ms"])
        lines += [
            "",
            f"- mean TTFT {_lower(mean_cut)}, p95 {_lower(p95_cut)} than least-load",
            "",
        ]
    elif llama:
        lines += [f"Real llama-servers: skipped: {llama['skipped']}.", ""]
    cost = n["cost"]
    lines += [
        f"- routing work per request, {cost['prompt_bytes'] // 1024} KB prompt, "
        f"{cost['workers']} workers: cache-aware {cost['cache_aware_us']} µs, predicted "
        f"{cost['predicted_us']} µs (its choice, its record, and learning from the answer): "
        f"{cost['extra_us']} µs more (≤ {EXTRA_US:.0f} µs): {_met(cost['extra_us'] <= EXTRA_US)}",
        "",
        _default_verdict(n),
        "",
    ]
    return lines


def _default_verdict(n: dict[str, Any]) -> str:
    """Whether ``predicted`` should become the default, from what was measured."""
    pools = n["pools"]
    mixed = [p for n_, p in pools.items() if n_.startswith("mixed") and "heavy" not in n_]
    same = [p for n_, p in pools.items() if not n_.startswith("mixed")]
    better = all(
        (_cut(p["least_load"]["mean_ttft_ms"], p["predicted"]["mean_ttft_ms"]) or 0) > 0
        for p in mixed
    )
    no_worse = all(
        (_cut(p["least_load"]["mean_ttft_ms"], p["predicted"]["mean_ttft_ms"]) or 0) >= -SAME_BAND
        for p in same
    )
    cheap = n["cost"]["extra_us"] <= EXTRA_US
    conversations = n.get("conversations")
    keeps_cache = False
    if conversations:
        aware, predicted = conversations["cache_aware"], conversations["predicted"]
        keeps_cache = (
            predicted["recomputed_per_turn"] <= 1.1 * aware["recomputed_per_turn"]
            and predicted["ttft_ms"] <= (1 + SAME_BAND) * aware["ttft_ms"]
        )
    llama = n.get("llama_server") or {}
    real_ok = True
    if "least_load" in llama:
        least, pred = llama["least_load"], llama["predicted"]
        real_ok = all(
            (_cut(least[k], pred[k]) or 0) >= -SAME_BAND for k in ("mean_ttft_ms", "p95_ttft_ms")
        )
    shipped = (
        " The shipped default stays `cache_aware` so that an upgrade does not change how a "
        "running fleet is routed; docs/OPERATIONS.md tells operators of mixed boxes to set "
        "`ROUTING_POLICY=predicted`."
    )
    if better and no_worse and cheap and keeps_cache and real_ok:
        return (
            "**Default:** on these measurements `predicted` could be the default "
            "ROUTING_POLICY: it is faster on every mixed pool, no slower on identical "
            "boxes or on the real llama-server pair, keeps what the prompt cache gives "
            "conversations (a worker's cached prefix is prompt it need not process, within "
            "the same bounded-load guard), and costs a few µs per request. It starts from "
            "the fleet's speeds and learns within seconds." + shipped
        )
    return (
        "**Default:** `cache_aware` stays the default on these measurements (`predicted` "
        f"faster on every mixed pool: {better}; no slower on identical boxes: {no_worse}; "
        f"no slower, mean and p95, on the real llama-server pair: {real_ok}; keeps what "
        f"the cache gives conversations: {keeps_cache}; within the cost budget: {cheap}); "
        "`predicted` is the choice for a pool of boxes of different speeds."
    )
