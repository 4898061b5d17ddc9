"""The worker as a wheel, built by the relay from the tree it runs.

``/setup`` offers ``/setup/modelrelay_worker-<version>-py3-none-any.whl`` for ``pip
install``: the ``modelrelay-worker`` distribution that ``pyproject.toml`` describes and
``make worker-wheel`` builds with its pinned build backend. The relay writes the same
archive itself, on first request, so that ``make run`` serves it on a fresh machine
with nothing to install and no index to reach: the modules of :mod:`relay.pages.bundle`
(``relay/__init__.py``, ``relay/wire/``, ``relay/worker/``; none imports Django),
``Requires-Dist`` from ``requirements-worker.txt`` line by line (as setuptools reads
it), the name, summary, Python bound and console script from ``pyproject.toml``, the
version from :data:`relay.__version__`. ``tests/worker/test_package.py`` builds both
and compares them.

The wheel format (PEP 427, the binary distribution format of the packaging guide):
a zip of the modules plus ``<name>-<version>.dist-info/`` with ``METADATA``, ``WHEEL``,
``entry_points.txt`` and ``RECORD`` (each file's SHA-256 and size). Its bytes are
reproducible (fixed timestamps, sorted names); it is kept in memory until a source
file changes.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import threading
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from relay import __version__
from relay.pages import bundle

PYPROJECT = bundle.ROOT / "pyproject.toml"
_EPOCH = (1980, 1, 1, 0, 0, 0)
#: A distribution name's runs of ``-``, ``_`` and ``.`` are one ``_`` in a wheel's names.
_ESCAPE = re.compile(r"[-_.]+")


class WheelError(RuntimeError):
    """The worker's wheel cannot be built (a source file is missing or imports Django)."""


@dataclass(frozen=True)
class Wheel:
    filename: str
    data: bytes
    members: tuple[str, ...]
    sha256: str


@dataclass(frozen=True)
class Project:
    """What ``pyproject.toml`` says of the distribution."""

    name: str
    version: str
    summary: str
    requires_python: str
    requires: tuple[str, ...]
    scripts: tuple[tuple[str, str], ...]

    @property
    def stem(self) -> str:
        """``<name>-<version>`` as wheel file names spell them (the binary distribution
        format: the name normalised with ``_``, a ``-`` in the version as ``_``)."""
        return f"{_ESCAPE.sub('_', self.name).lower()}-{self.version.replace('-', '_')}"

    @property
    def filename(self) -> str:
        return f"{self.stem}-py3-none-any.whl"

    @property
    def dist_info(self) -> str:
        return f"{self.stem}.dist-info"


def requirements(text: str) -> tuple[str, ...]:
    """The requirement lines of a requirements file as setuptools' ``file:`` reads them:
    comments and blank lines dropped, each line stripped."""
    lines = (line.split(" #", 1)[0].strip() for line in text.splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


def project() -> Project:
    """The distribution as ``pyproject.toml`` and ``requirements-worker.txt`` describe it."""
    try:
        document = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
        table = document["project"]
        requires = requirements(bundle.REQUIREMENTS.read_text(encoding="utf-8"))
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise WheelError(f"cannot read the worker's package description: {exc}") from exc
    return Project(
        name=str(table["name"]),
        version=__version__,
        summary=str(table.get("description", "")),
        requires_python=str(table.get("requires-python", "")),
        requires=requires,
        scripts=tuple(sorted((str(k), str(v)) for k, v in table.get("scripts", {}).items())),
    )


def metadata(info: Project) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {info.name}",
        f"Version: {info.version}",
        f"Summary: {info.summary}",
    ]
    if info.requires_python:
        lines.append(f"Requires-Python: {info.requires_python}")
    lines += [f"Requires-Dist: {requirement}" for requirement in info.requires]
    return "\n".join(lines) + "\n"


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build() -> Wheel:
    """The wheel, from the files on disk now."""
    try:
        files = bundle.checked(bundle.package_sources())
    except bundle.BundleError as exc:
        raise WheelError(str(exc)) from exc
    info = project()
    contents: dict[str, bytes] = {name: path.read_bytes() for name, path in files.items()}
    meta = info.dist_info
    contents[f"{meta}/METADATA"] = metadata(info).encode()
    contents[f"{meta}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: modelrelay (relay/pages/wheel.py)\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n"
    )
    scripts = "".join(f"{name} = {target}\n" for name, target in info.scripts)
    contents[f"{meta}/entry_points.txt"] = f"[console_scripts]\n{scripts}".encode()
    contents[f"{meta}/top_level.txt"] = b"relay\n"
    record = [f"{name},{_record_hash(data)},{len(data)}" for name, data in contents.items()]
    contents[f"{meta}/RECORD"] = ("\n".join([*record, f"{meta}/RECORD,,"]) + "\n").encode()
    buffer = io.BytesIO()
    # The modules first, the dist-info last (RECORD at the very end), as installers expect.
    order = sorted(contents, key=lambda n: (n.startswith(meta), n.endswith("/RECORD"), n))
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name in order:
            entry = zipfile.ZipInfo(name, date_time=_EPOCH)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = 0o644 << 16
            archive.writestr(entry, contents[name])
    data = buffer.getvalue()
    return Wheel(info.filename, data, tuple(order), hashlib.sha256(data).hexdigest())


_lock = threading.Lock()
_cached: tuple[tuple[tuple[str, int, int], ...], Wheel] | None = None


def _fingerprint(paths: list[Path]) -> tuple[tuple[str, int, int], ...]:
    stats = [(str(p), p.stat()) for p in paths]
    return tuple((name, st.st_mtime_ns, st.st_size) for name, st in stats)


def worker_wheel() -> Wheel:
    """The current wheel; rebuilt only when one of its source files changed."""
    global _cached
    with _lock:
        if _cached is not None:
            key, built = _cached
            try:
                if _fingerprint([Path(name) for name, _, _ in key]) == key:
                    return built
            except OSError:
                pass
        paths = sorted({*bundle.package_sources().values(), PYPROJECT, bundle.REQUIREMENTS})
        key = _fingerprint(paths)
        built = build()
        _cached = (key, built)
        return built


def wheel_filename() -> str:
    """The wheel's file name (``modelrelay_worker-<version>-py3-none-any.whl``) without
    building it."""
    return project().filename
