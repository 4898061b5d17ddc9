"""The summary table ``make chaos`` prints, and the details of every failed check."""

from __future__ import annotations

from chaos.known import explained, unexplained
from chaos.outcome import Outcome


def _verdicts(out: Outcome) -> str:
    counts = out.verdicts()
    return ", ".join(f"{verdict} {n}" for verdict, n in sorted(counts.items())) or "-"


def table(outcomes: list[tuple[str, Outcome]]) -> str:
    """A Markdown table: one row per scenario run (server, requests, answers, checks)."""
    rows = [
        "| scenario | server | requests | answers | checks | result | time |",
        "|---|---|---:|---|---|---|---:|",
    ]
    for server, out in outcomes:
        passed = sum(1 for c in out.checks if c.ok)
        new = [c.name for c in unexplained(out, server)]
        known = [k.key for k in explained(out, server)]
        parts = []
        if new:
            parts.append("FAIL: " + ", ".join(new))
        if known:
            parts.append("known: " + ", ".join(known))
        result = "; ".join(parts) or "pass"
        rows.append(
            f"| {out.name} | {server} | {len(out.calls)} | {_verdicts(out)} | "
            f"{passed}/{len(out.checks)} | {result} | {out.seconds:.0f} s |"
        )
    return "\n".join(rows)


def figures(outcomes: list[tuple[str, Outcome]]) -> str:
    lines = []
    for server, out in outcomes:
        if out.figures:
            shown = ", ".join(f"{k}: {v}" for k, v in out.figures.items())
            lines.append(f"- {out.name} ({server}): {shown}")
    return "\n".join(lines)


def failures(outcomes: list[tuple[str, Outcome]]) -> str:
    lines = []
    for server, out in outcomes:
        new = unexplained(out, server)
        for check in out.failures:
            mark = "FAILED" if check in new else "KNOWN "
            lines.append(f"{mark} {out.name} ({server}) / {check.name}: {check.detail}")
    return "\n".join(lines)


def checks(outcomes: list[tuple[str, Outcome]]) -> str:
    """Every check with its detail (the verbose listing)."""
    lines = []
    for server, out in outcomes:
        lines.append(f"{out.name} ({server}): {out.title}")
        for check in out.checks:
            mark = "ok  " if check.ok else "FAIL"
            lines.append(
                f"  {mark} {check.name}: {check.detail.splitlines()[0] if check.detail else ''}"
            )
    return "\n".join(lines)


def known_legend(outcomes: list[tuple[str, Outcome]]) -> str:
    seen: dict[str, str] = {}
    for server, out in outcomes:
        for known in explained(out, server):
            seen.setdefault(known.key, known.summary)
    return "\n".join(f"- {key}: {summary}" for key, summary in seen.items())
