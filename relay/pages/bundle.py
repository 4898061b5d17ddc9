"""``worker.pyz``: the worker as one file a GPU box can download and run without git.

The zipapp holds the repository's ``worker.py`` as ``__main__.py`` plus the packages
that ship to GPU boxes, taken whole from the tree: ``relay/__init__.py``,
``relay/wire/`` and ``relay/worker/`` (see :mod:`relay`). ``python3 worker.pyz --help``
works anywhere the worker's pinned dependencies (``requirements-worker.txt``) are
installed. Building refuses a bundle whose files import Django or any ``relay``
module outside those packages. The archive is built on first request and kept in
memory until a source file changes; its bytes are reproducible (fixed timestamps,
sorted names).
"""

from __future__ import annotations

import ast
import hashlib
import io
import re
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "worker.py"
REQUIREMENTS = ROOT / "requirements-worker.txt"
SHEBANG = b"#!/usr/bin/env python3\n"
#: The packages (besides ``relay/__init__.py``) that make up the worker on a GPU box.
SHIPPED_PACKAGES = ("relay.wire", "relay.worker")
_FORBIDDEN = frozenset({"django", "channels", "daphne", "asgiref"})
_EPOCH = (1980, 1, 1, 0, 0, 0)
_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


class BundleError(RuntimeError):
    """The worker cannot be bundled (a source file is missing or imports Django)."""


@dataclass(frozen=True)
class Bundle:
    data: bytes
    members: tuple[str, ...]
    sha256: str


def _imports(source: str, filename: str) -> tuple[set[str], set[str]]:
    """(relay modules, other top-level packages) imported anywhere in ``source``."""
    relay: set[str] = set()
    other: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module in ("relay", *SHIPPED_PACKAGES):
                names += [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name == "relay" or name.startswith("relay."):
                relay.add(name)
            else:
                other.add(name.split(".")[0])
    return relay, other


def _shipped(name: str) -> bool:
    """True for ``relay`` modules the bundle carries (its version, the wire, the worker)."""
    if name in ("relay", "relay.__version__"):
        return True
    return any(name == package or name.startswith(package + ".") for package in SHIPPED_PACKAGES)


def sources() -> dict[str, Path]:
    """Archive name -> source file: ``__main__.py`` and the shipped ``relay`` packages."""
    if not WORKER.is_file():
        raise BundleError(f"{WORKER} is missing")
    return checked({"__main__.py": WORKER, **package_sources()})


def package_sources() -> dict[str, Path]:
    """Archive name -> source file of the shipped ``relay`` modules (what the worker's
    wheel holds, :mod:`relay.pages.wheel`), not yet checked."""
    found: dict[str, Path] = {"relay/__init__.py": ROOT / "relay/__init__.py"}
    for package in SHIPPED_PACKAGES:
        folder = ROOT.joinpath(*package.split("."))
        for path in sorted(folder.rglob("*.py")):
            found[path.relative_to(ROOT).as_posix()] = path
    return found


def checked(found: dict[str, Path]) -> dict[str, Path]:
    """``found``, once none of its files imports Django or a ``relay`` module the worker
    does not ship (raises :class:`BundleError` naming the first that does)."""
    for arcname, path in found.items():
        relay, other = _imports(path.read_text(encoding="utf-8"), str(path))
        if other & _FORBIDDEN:
            raise BundleError(f"{arcname} imports {sorted(other & _FORBIDDEN)}")
        outside = sorted(name for name in relay if not _shipped(name))
        if outside:
            raise BundleError(f"{arcname} imports {outside}, which the worker does not ship")
    return found


def build() -> Bundle:
    files = sources()
    buffer = io.BytesIO()
    buffer.write(SHEBANG)
    with zipfile.ZipFile(buffer, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        for arcname in sorted(files):
            info = zipfile.ZipInfo(arcname, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, files[arcname].read_bytes())
    data = buffer.getvalue()
    return Bundle(data, tuple(sorted(files)), hashlib.sha256(data).hexdigest())


_lock = threading.Lock()
_cached: tuple[tuple[tuple[str, int, int], ...], Bundle] | None = None


def _fingerprint(paths: list[Path]) -> tuple[tuple[str, int, int], ...]:
    stats = [(str(p), p.stat()) for p in paths]
    return tuple((name, st.st_mtime_ns, st.st_size) for name, st in stats)


def worker_bundle() -> Bundle:
    """The current bundle; rebuilt only when one of its source files changed."""
    global _cached
    with _lock:
        if _cached is not None:
            key, bundle = _cached
            try:
                if _fingerprint([Path(name) for name, _, _ in key]) == key:
                    return bundle
            except OSError:
                pass
        paths = sorted(set(sources().values()))
        key = _fingerprint(paths)
        bundle = build()
        _cached = (key, bundle)
        return bundle


def worker_requirements() -> list[str]:
    """The ``name==version`` pins to install for the worker, from requirements-worker.txt.

    Only the packages the bundled files (``worker.py`` and its relay modules) import
    directly (their own dependencies come along); every pin when none of them can be
    matched.
    """
    pins: list[tuple[str, str]] = []
    for line in REQUIREMENTS.read_text(encoding="utf-8").splitlines():
        match = _PIN.match(line)
        if match:
            pins.append((match.group(1), match.group(2)))
    imported: set[str] = set()
    for path in sources().values():
        imported |= _imports(path.read_text(encoding="utf-8"), str(path))[1]
    normal = {name.lower().replace("_", "-") for name in imported}
    direct = [(n, v) for n, v in pins if n.lower().replace("_", "-") in normal]
    return [f"{n}=={v}" for n, v in (direct or pins)]
