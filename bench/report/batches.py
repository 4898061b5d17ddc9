"""(i) batches on idle capacity: what a batch costs interactive users, and what it gets."""

from __future__ import annotations

from typing import Any

from bench.report.table import num, table

#: The targets: interactive p95 with a batch running, against its batch-free baseline;
#: the batch's throughput with the interactive trickle alongside, against alone.
INTERACTIVE_P95_RATIO = 1.15
BATCH_THROUGHPUT_SHARE = 0.85


def _met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def batches(res: dict[str, Any]) -> list[str]:
    i = res.get("batches")
    if not i:
        return []
    lines = [
        "### (i) Batches on idle capacity",
        "",
        f"A batch of {i['lines']:,} chat completions on two worker.py ({i['slots']} slots in "
        f"all) in front of an upstream with a fixed {i['service_ms']:.0f} ms service time, "
        "with and without an interactive trickle of one non-streaming request per second.",
        "",
    ]
    rows, targets = [], []
    for name, v in i["variants"].items():
        base, along, alone = v["baseline"], v["alongside"], v["alone"]
        inter = along["interactive"]
        p95_ratio = inter["p95_ms"] / base["p95_ms"] if base["p95_ms"] else float("nan")
        share = along["lines_per_sec"] / alone["lines_per_sec"] if alone["lines_per_sec"] else 0
        rows.append(
            [
                name,
                f"{num(base['p95_ms'], 0)} ms ({base['n']})",
                f"{num(inter['p95_ms'], 0)} ms ({inter['n']})",
                f"{p95_ratio:.2f}x",
                num(alone["lines_per_sec"], 1),
                num(along["lines_per_sec"], 1),
                f"{100 * share:.0f} %",
            ]
        )
        targets += [
            [
                f"{name}: interactive p95 with a batch ≤ {INTERACTIVE_P95_RATIO:g}x without",
                f"{p95_ratio:.2f}x",
                _met(p95_ratio <= INTERACTIVE_P95_RATIO),
            ],
            [
                f"{name}: batch alongside ≥ {100 * BATCH_THROUGHPUT_SHARE:.0f} % of alone",
                f"{100 * share:.0f} %",
                _met(share >= BATCH_THROUGHPUT_SHARE),
            ],
        ]
    head = [
        "batch settings",
        "interactive p95, no batch (n)",
        "with the batch (n)",
        "ratio",
        "batch alone, lines/s",
        "batch alongside, lines/s",
        "alongside / alone",
    ]
    lines += [*table(head, rows), ""]
    k = i["kill"]
    targets.append(
        [
            "server SIGKILLed mid-batch, started again: each custom_id exactly once in the output",
            f"killed at {k['killed_at']:,}/{k['lines']:,}; {k['unique']:,} ids, "
            f"{k['duplicates']} twice, {k['missing']} missing; ended {k['status']} "
            f"{k['resumed_secs']:.1f} s after the restart",
            _met(bool(k["exactly_once"])),
        ]
    )
    lines += [*table(["target", "measured", ""], targets), ""]
    return lines
