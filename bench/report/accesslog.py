"""What one access-log line per request costs the server (measured with (a))."""

from __future__ import annotations

import statistics
from typing import Any

from bench.report.table import num, per, table


def access_log(res: dict[str, Any]) -> list[str]:
    runs = res.get("access_log")
    if not runs or not runs.get("false") or not runs.get("true"):
        return []
    off = [per(r, "server", "requests") for r in runs["false"]]
    on = [per(r, "server", "requests") for r in runs["true"]]
    pairs = [b - a for a, b in zip(off, on, strict=True) if a is not None and b is not None]
    rows = []
    for label, values in (("`false`", off), ("`true` (the default)", on)):
        known = [v for v in values if v is not None]
        rows.append(
            [
                label,
                num(statistics.median(known), 0) if known else "-",
                ", ".join(num(v, 0) for v in known),
            ]
        )
    lines = [
        "### Access log — what one line per request costs",
        "",
        f"Scenario (a) again on daphne, {len(pairs)} alternated pair(s) of runs with "
        "`ACCESS_LOG` off and on (the default), the server's lines in the default text "
        "format written to its log file. Server CPU per relayed non-streaming request, as "
        "(d) measures it:",
        "",
        *table(["ACCESS_LOG", "µs / request (median)", "runs (µs)"], rows),
    ]
    if pairs:
        median = statistics.median(pairs)
        base = statistics.median(v for v in off if v is not None)
        lines += [
            "",
            f"Difference within each pair, median: {median:+.0f} µs per request "
            f"({100 * median / base:+.0f} %). The request observer only names the key and "
            "queues the record; the access-log thread builds the lines of each 50 ms and "
            "writes them in one write.",
        ]
    return [*lines, ""]
