"""Product failures the harness has found and that are not fixed yet (none today).

Each entry names the check it makes fail and exactly which of that check's counted
problems it explains (verdicts, case labels, problem kinds, log signatures), and
under which server. A failing check is *explained* only when every problem it
counted belongs to a known entry; anything else is a new failure.
``tests/test_chaos.py`` marks a scenario xfail (naming the entries) when all its
failures are explained, and fails it otherwise. docs/RELIABILITY.md describes each.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from chaos.outcome import Check, Outcome

BOTH = frozenset({"daphne", "uvicorn"})
UVICORN = frozenset({"uvicorn"})


@dataclass(frozen=True)
class Known:
    key: str
    summary: str
    check: str
    #: The check's ``data`` field the problems are listed under, and the ones explained
    #: (shell-style patterns: a counted problem is explained when it matches one).
    field: str
    problems: frozenset[str]
    servers: frozenset[str] = BOTH


#: Empty: every failure the harness found so far is fixed (docs/RELIABILITY.md lists
#: them and what changed). A failure found later and not fixed at once goes here.
KNOWN: list[Known] = []


def explains(check: Check, server: str) -> list[Known]:
    """The known entries that together explain every problem ``check`` counted, or []."""
    if check.ok:
        return []
    applicable = [k for k in KNOWN if k.check == check.name and server in k.servers]
    used: dict[str, Known] = {}
    counted = 0
    for known_field in {k.field for k in applicable}:
        problems = check.data.get(known_field)
        if not isinstance(problems, dict):
            continue
        for problem in problems:
            counted += 1
            match = [k for k in applicable if k.field == known_field and _covers(k, problem)]
            if not match:
                return []
            used.update((k.key, k) for k in match)
    return list(used.values()) if counted else []


def _covers(known: Known, problem: str) -> bool:
    return any(fnmatch.fnmatchcase(problem, pattern) for pattern in known.problems)


def unexplained(outcome: Outcome, server: str) -> list[Check]:
    return [c for c in outcome.failures if not explains(c, server)]


def explained(outcome: Outcome, server: str) -> list[Known]:
    found: dict[str, Known] = {}
    for check in outcome.failures:
        for known in explains(check, server):
            found[known.key] = known
    return list(found.values())
