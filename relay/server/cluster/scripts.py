"""The Lua scripts behind :mod:`relay.server.cluster.state`: each decision that must be
atomic across server processes runs in Redis alone.

Keys are those listed in :mod:`relay.server.cluster.state`. A worker counts as live only
while its process's address key exists *and* that process lists it (``pw``): the
per-model sets (``m``) are hints, pruned of anything a live process does not confirm,
so a worker can never be offered after its process dropped it or died.

The scripts are kept as ``.lua`` files in ``lua/`` next to this module (so they can be
read, diffed and linted as Lua) and read once, at import; the shared fragments
(``live.lua``, ``lanes.lua``, ``now.lua``) are prepended to the scripts that use them.
"""

from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).with_name("lua")


def lua(*names: str) -> str:
    """The source of ``lua/<name>.lua`` for each name, in order, as one script."""
    return "".join((_DIR / f"{name}.lua").read_text(encoding="utf-8") for name in names)


PLACE = lua("live", "lanes", "place")
RELEASE = lua("live", "lanes", "release")
WITHDRAW = lua("lanes", "withdraw")
EXTEND = lua("extend")
ANNOUNCE = lua("announce")
SERVED = lua("served")
LOOKUP = lua("live", "lookup")
WHERE = lua("where")
WANT = lua("live", "want")
LOAD_DONE = lua("loaddone")
