"""What every report section is made of: the targets' labels, cells and Markdown tables.

Also the two figures read off a measured window: a process's CPU *share* of one core
and its CPU *per* request, stream event or whatever the window counted.
"""

from __future__ import annotations

import math
from typing import Any

#: ModelRelay as deployed (daphne) and with ``manage.py serve --server uvicorn``.
DEFAULT = "ModelRelay"
UVICORN = "ModelRelay (uvicorn)"
RELAYS = (DEFAULT, UVICORN)
#: Each ModelRelay deployment's server, and its name in column headers.
SERVER = {DEFAULT: "daphne (default)", UVICORN: "uvicorn"}
HEADER = {DEFAULT: "ModelRelay (daphne, default)", UVICORN: "ModelRelay (uvicorn)"}
ORDER = ("direct", DEFAULT, UVICORN, "LiteLLM", "nginx")
PEERS = ("direct", "LiteLLM", "nginx")
#: Processes whose CPU is the target's own (the rest is the rig: client, upstream, workers).
OWN = {
    DEFAULT: ("server",),
    UVICORN: ("server",),
    "LiteLLM": ("litellm",),
    "nginx": ("nginx",),
    "direct": (),
}
RIG = ("client", "upstream", "workers")


def num(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    if not a or not b or math.isnan(a) or math.isnan(b):
        return "-"
    r = a / b
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def share(run: dict[str, Any], names: tuple[str, ...]) -> float:
    """CPU of ``names`` over the run's window, in % of one core."""
    wall = run.get("wall") or 0
    used = sum(run.get("cpu", {}).get(n, 0.0) for n in names)
    return 100 * used / wall if wall else float("nan")


def per(run: dict[str, Any] | None, name: str, count_key: str) -> float | None:
    """µs of ``name``'s CPU per unit of ``run[count_key]`` (requests, chunks, ...)."""
    if not run:
        return None
    count = run.get(count_key) or 0
    used = run.get("cpu", {}).get(name)
    if not count or used is None:
        return None
    return 1e6 * used / count


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def present(section: dict[str, Any]) -> list[str]:
    """The targets measured in ``section``, in report order."""
    return [t for t in ORDER if t in section]
