"""py-spy profiles of benchmark processes, summarised as "top functions".

``py-spy record --format raw`` writes collapsed stacks (``frame;frame;... count``).
:func:`top` turns them into the functions with the most samples on-CPU: *self* counts
samples where the function is the innermost frame, *total* counts samples where it is
anywhere on the stack (once per sample). *Packages* attribute each sample to the
innermost frame outside the standard library that runs inside the event loop: the
code that asked for the work, e.g. daphne or Twisted rather than ``socket.send``.
Samples with no such frame (the loop itself: polling, scheduling; uvloop's C loop
under ``asyncio.Runner.run``) count as ``stdlib``, not as the code that started the
loop.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

_LINE = re.compile(r"^(.*) (\d+)$")
#: ``function (file.py:123)`` -> ``function (file.py)``: merge lines of one function.
_FRAME_LINE = re.compile(r":\d+\)$")
#: ``function (pkg/mod.py)`` -> ``pkg/mod.py``
_FRAME_FILE = re.compile(r"\(([^()]*)\)$")
_STDLIB = set(sys.stdlib_module_names) | {"stdlib", "<frozen", "<string>"}
#: Files of asyncio's event loop: frames below them started the loop, not this work.
_LOOP_FILES = ("(asyncio/base_events.py)", "(asyncio/runners.py)", "(asyncio/events.py)")


@dataclass
class Profile:
    samples: int
    self_counts: dict[str, int]
    total_counts: dict[str, int]
    package_counts: dict[str, int] = field(default_factory=dict)

    def packages(self) -> dict[str, float]:
        """Share (%) of samples per package, by the innermost non-stdlib frame."""
        if not self.samples:
            return {}
        ranked = sorted(self.package_counts.items(), key=lambda kv: -kv[1])
        return {name: 100 * count / self.samples for name, count in ranked}

    def top(self, n: int = 12) -> list[tuple[str, float, float]]:
        """``(function, self %, total %)`` by self samples, the busiest first."""
        if not self.samples:
            return []
        ranked = sorted(self.self_counts.items(), key=lambda kv: -kv[1])[:n]
        return [
            (name, 100 * count / self.samples, 100 * self.total_counts[name] / self.samples)
            for name, count in ranked
        ]

    def top_total_in(
        self, markers: tuple[str, ...], n: int = 10, skip: tuple[str, ...] = ()
    ) -> list[tuple[str, float]]:
        """Inclusive time of the busiest functions whose location contains one of ``markers``
        (and none of ``skip``)."""
        chosen = {
            k: v
            for k, v in self.total_counts.items()
            if any(m in k for m in markers) and not any(s in k for s in skip)
        }
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


def package(frame: str) -> str:
    """Top-level package (or module file) of a shortened frame; ``stdlib`` for Python's own."""
    match = _FRAME_FILE.search(frame)
    path = match.group(1) if match else ""
    top = path.split("/", 1)[0].split(" ", 1)[0]
    name = top.removesuffix(".py")
    if not name or name in _STDLIB or path.startswith("stdlib/"):
        return "stdlib"
    return top


def _owner(frames: list[str]) -> str:
    """Package of the innermost non-stdlib frame above the event loop's own frames."""
    for frame in reversed(frames):
        if frame.endswith(_LOOP_FILES):
            return "stdlib"
        name = package(frame)
        if name != "stdlib":
            return name
    return "stdlib"


def parse(path: Path) -> Profile:
    self_counts: dict[str, int] = {}
    total_counts: dict[str, int] = {}
    package_counts: dict[str, int] = {}
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
        owner = _owner(frames)
        package_counts[owner] = package_counts.get(owner, 0) + count
    return Profile(samples, self_counts, total_counts, package_counts)


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
