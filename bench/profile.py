"""py-spy profiles of benchmark processes, summarised as "top functions".

``py-spy record --format raw`` writes collapsed stacks (``frame;frame;... count``).
:func:`top` turns them into the functions with the most samples on-CPU: *self* counts
samples where the function is the innermost frame, *total* counts samples where it is
anywhere on the stack (once per sample).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r"^(.*) (\d+)$")
#: ``function (file.py:123)`` -> ``function (file.py)``: merge lines of one function.
_FRAME_LINE = re.compile(r":\d+\)$")


@dataclass
class Profile:
    samples: int
    self_counts: dict[str, int]
    total_counts: dict[str, int]

    def top(self, n: int = 12) -> list[tuple[str, float, float]]:
        """``(function, self %, total %)`` by self samples, the busiest first."""
        if not self.samples:
            return []
        ranked = sorted(self.self_counts.items(), key=lambda kv: -kv[1])[:n]
        return [
            (name, 100 * count / self.samples, 100 * self.total_counts[name] / self.samples)
            for name, count in ranked
        ]

    def top_total_in(self, markers: tuple[str, ...], n: int = 10) -> list[tuple[str, float]]:
        """Inclusive time of the busiest functions whose location contains one of ``markers``."""
        chosen = {k: v for k, v in self.total_counts.items() if any(m in k for m in markers)}
        ranked = sorted(chosen.items(), key=lambda kv: -kv[1])[:n]
        return [(name, 100 * count / self.samples) for name, count in ranked]

    def top_total(self, n: int = 12) -> list[tuple[str, float]]:
        ranked = sorted(self.total_counts.items(), key=lambda kv: -kv[1])[:n]
        return [(name, 100 * count / self.samples) for name, count in ranked]


def _short(frame: str) -> str:
    frame = _FRAME_LINE.sub(")", frame.strip())
    # Keep the path short: site-packages/<pkg>/..., or the repo-relative path.
    for marker in ("site-packages/", "/lib/python3."):
        at = frame.find(marker)
        if at >= 0:
            start = frame.rfind("(", 0, at) + 1
            tail = frame[at + len(marker) :]
            if marker != "site-packages/":
                tail = "stdlib/" + tail.split("/", 1)[-1]
            frame = frame[:start] + tail
    return frame.replace("/work/main/", "")


def parse(path: Path) -> Profile:
    self_counts: dict[str, int] = {}
    total_counts: dict[str, int] = {}
    samples = 0
    for line in path.read_text(errors="replace").splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        stack, count = match.group(1), int(match.group(2))
        frames = [_short(f) for f in stack.split(";") if f]
        # py-spy puts "process ..." and "thread ..." first when asked for them
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        samples += count
        leaf = frames[-1]
        self_counts[leaf] = self_counts.get(leaf, 0) + count
        for name in set(frames):
            total_counts[name] = total_counts.get(name, 0) + count
    return Profile(samples, self_counts, total_counts)


def command(py_spy: str, pid: int, out: Path, duration: float, rate: int = 250) -> list[str]:
    """``py-spy record`` of ``pid`` for ``duration`` s: samples holding the GIL, raw format.

    ``--gil`` keeps only samples of the thread running Python, so a thread waiting on
    a lock or in ``epoll`` is not counted: the result is where the CPU goes.
    ``--nonblocking`` samples without pausing the process (no effect on its timing).
    """
    return [
        py_spy,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, round(duration))),
        "--rate",
        str(rate),
        "--gil",
        "--nonblocking",
        "--format",
        "raw",
        "--output",
        str(out),
    ]
