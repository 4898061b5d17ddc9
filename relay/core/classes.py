"""Priority classes (SPEC §15): ``priority`` > ``default`` > ``flex``.

OpenAI's own ``service_tier`` names. A request asks for one with ``service_tier`` in
its body or an ``X-Priority`` header (any endpoint, the header winning); its API key
gives the class it gets when it asks for none and the highest it may get (asking above
is clamped, not refused). What a request gets is its *class*; its *rank* is the class's
index in :data:`CLASSES` (0 is the highest), lowered by one while it waits past the aging
bound (:mod:`relay.core.classqueue`).
"""

from __future__ import annotations

from typing import Final

from relay.wire.errors import BadRequest

PRIORITY: Final = "priority"
DEFAULT: Final = "default"
FLEX: Final = "flex"
#: Highest first: a class's rank is its index.
CLASSES: Final = (PRIORITY, DEFAULT, FLEX)
RANK: Final = {name: rank for rank, name in enumerate(CLASSES)}
FLEX_RANK: Final = RANK[FLEX]

#: ``service_tier`` values (OpenAI's and Anthropic's) and what they ask for; None: the
#: key's default class.
_TIERS: Final[dict[str, str | None]] = {
    "auto": None,
    "default": DEFAULT,
    "standard_only": DEFAULT,  # Anthropic
    "flex": FLEX,
    "priority": PRIORITY,
    "scale": PRIORITY,  # OpenAI's reserved-capacity tier
}


def asked(header: bytes | None, service_tier: object) -> str | None:
    """The class a request asks for (None: none, the key's default applies); raises
    :class:`BadRequest` for a value that names no class."""
    if header is not None:
        name = header.decode("latin-1").strip().lower()
        if name in ("", "auto"):
            return None
        if name not in RANK:
            raise BadRequest("X-Priority must be one of priority, default, flex")
        return name
    if service_tier is None:
        return None
    if not isinstance(service_tier, str) or service_tier not in _TIERS:
        raise BadRequest(
            "'service_tier' must be one of auto, default, flex, priority, scale, standard_only"
        )
    return _TIERS[service_tier]


def resolve(wanted: str | None, default: str = DEFAULT, highest: str = PRIORITY) -> str:
    """The class a request gets: ``wanted`` (or ``default``), never above ``highest``."""
    name = wanted or default
    return name if RANK[name] >= RANK[highest] else highest


def validate(name: str) -> str:
    """``name`` if it is a class (for settings and the admin); ValueError otherwise."""
    if name not in RANK:
        raise ValueError(f"unknown class {name!r}: use one of {', '.join(CLASSES)}")
    return name
