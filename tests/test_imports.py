"""Imports go one way: worker -> wire; core -> wire; server -> core -> wire; pages -> server.

Two checks: a static one over every module's import statements (including imports
inside functions and ``TYPE_CHECKING`` blocks, so no circle can hide behind a lazy
import), and a live one importing each package in a fresh interpreter and looking at
what got loaded (no Django for the worker and the core).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RELAY = ROOT / "relay"

#: What each package may import of ours (besides itself and ``relay``'s version).
ALLOWED: dict[str, set[str]] = {
    "wire": set(),
    "worker": {"wire"},
    "core": {"wire"},
    "server": {"core", "wire"},
    "pages": {"server", "core", "wire"},
}
#: Our Django apps and site: only the edges may use them.
DJANGO_SIDE = {
    "django",
    "channels",
    "daphne",
    "asgiref",
    "ninja",
    "workers_app",
    "keys",
    "batches",
}
DJANGO_FREE = {"wire", "worker", "core"}


def relay_imports(path: Path) -> set[str]:
    """Every ``relay.<package>`` and Django-side top-level name ``path`` imports anywhere."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "relay":
                names = [f"relay.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "relay" and len(parts) > 1 and parts[1] != "__version__":
                found.add(parts[1])
            elif parts[0] in DJANGO_SIDE:
                found.add(parts[0])
    return found


def test_every_relay_module_lives_in_a_package():
    assert sorted(p.name for p in RELAY.glob("*.py")) == ["__init__.py"]
    assert {p.name for p in RELAY.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        ALLOWED
    )


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_only_down_the_layers(package):
    problems = []
    for path in sorted((RELAY / package).rglob("*.py")):
        for target in relay_imports(path) - {package}:
            if target in ALLOWED and target not in ALLOWED[package]:
                problems.append(f"{path.relative_to(ROOT)} imports relay.{target}")
            elif target in DJANGO_SIDE and package in DJANGO_FREE:
                problems.append(f"{path.relative_to(ROOT)} imports {target}")
    assert problems == []


def module_imports(path: Path) -> set[str]:
    """The ``relay`` modules ``path`` imports anywhere (lazy and ``TYPE_CHECKING`` ones too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("relay."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("relay"):
                continue
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                is_module = (ROOT / Path(*name.split("."))).with_suffix(".py").is_file()
                found.add(name if is_module else node.module)
    return {name for name in found if name.count(".") >= 2}


#: Our own top-level packages besides ``relay``: the Django apps and the site.
APPS = ("workers_app", "keys", "batches", "modelrelay_site")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def project_modules() -> dict[str, Path]:
    """Every module of ours: ``relay`` and the Django apps (migrations aside)."""
    paths = [p for p in RELAY.rglob("*.py") if p.name != "__init__.py"]
    for app in APPS:
        paths += [p for p in (ROOT / app).rglob("*.py") if "migrations" not in p.parts]
    return {_module_name(p): p for p in paths}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports anywhere (lazy and
    ``TYPE_CHECKING`` ones too); ``from package import module`` counts as the module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found & known


def test_no_module_imports_lead_in_a_circle():
    """Over ``relay`` and the Django apps together: the apps reach the running relay
    through ``relay.server.control`` only, and the server reads their models, never
    their services, so no circle crosses between them either."""
    modules = project_modules()
    known = set(modules)
    graph = {name: imports_of(path, known) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            raise AssertionError("import circle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_apps_reach_the_running_server_only_through_its_control_interface():
    modules = project_modules()
    known = set(modules)
    problems = []
    for name, path in modules.items():
        if name.split(".")[0] not in ("workers_app", "keys", "batches"):
            continue
        for target in imports_of(path, known):
            if target.startswith("relay.server.") and not (
                target == "relay.server.control" or target.startswith("relay.server.admin.")
            ):
                problems.append(f"{name} imports {target}")
    assert problems == []


#: The server's parts: each sub-package (or top-level module) and the other parts it
#: may import. Cluster mode knows nothing of the edges; the edges share the runtime.
SERVER_PARTS: dict[str, set[str]] = {
    "cluster": set(),
    "store": set(),
    "bookkeeper": set(),
    "metrics": set(),
    "federation": set(),
    "accesslog": set(),
    "tracing": set(),
    "cors": set(),
    "identities": {"bookkeeper"},
    "runtime": {
        "cluster",
        "store",
        "bookkeeper",
        "metrics",
        "federation",
        "accesslog",
        "tracing",
        "cors",
        "batches",
        "identities",
    },
    "control": {"runtime", "cluster"},
    "http": {"runtime", "cluster", "metrics", "tracing", "batches", "identities"},
    "batches": {"runtime", "store", "http", "cluster"},
    "socket": {"runtime", "store", "cluster", "identities"},
    "legacy": {"runtime", "store", "http", "socket"},
    "admin": {"runtime", "cluster"},
}


def test_the_server_is_made_of_named_parts():
    server = RELAY / "server"
    parts = {p.stem for p in server.glob("*.py") if p.name != "__init__.py"}
    parts |= {p.name for p in server.iterdir() if (p / "__init__.py").is_file()}
    assert parts == set(SERVER_PARTS)
    for package in [p for p in server.iterdir() if (p / "__init__.py").is_file()]:
        assert ast.get_docstring(ast.parse((package / "__init__.py").read_text())), package


def test_the_server_parts_import_only_what_they_may():
    modules = project_modules()
    known = set(modules)
    problems = []
    for name, path in modules.items():
        if not name.startswith("relay.server."):
            continue
        part = name.split(".")[2]
        for target in imports_of(path, known):
            if target.startswith("relay.server."):
                other = target.split(".")[2]
                if other != part and other not in SERVER_PARTS[part]:
                    problems.append(f"{name} imports {target}")
    assert problems == []


def test_worker_py_imports_only_the_shipped_packages():
    assert relay_imports(ROOT / "worker.py") <= {"wire", "worker"}


def loaded_after_importing(modules: list[str], *, django: bool = False) -> set[str]:
    """The module names loaded in a fresh interpreter after importing ``modules``."""
    setup = (
        "import os, django\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'modelrelay_site.settings')\n"
        "django.setup()\n"
        "before = set(sys.modules)\n"
        if django
        else "before = set()\n"
    )
    code = (
        "import importlib, sys\n" + setup + f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(sorted(set(sys.modules) - before)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def modules_of(package: str) -> list[str]:
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (RELAY / package).rglob("*.py")
    )


def ours(loaded: set[str], package: str) -> set[str]:
    return {m for m in loaded if m == f"relay.{package}" or m.startswith(f"relay.{package}.")}


def django_side(loaded: set[str]) -> set[str]:
    return {m for m in loaded if m.split(".")[0] in DJANGO_SIDE}


def test_the_worker_program_loads_only_the_wire_and_worker_packages_and_no_django():
    loaded = loaded_after_importing(["worker", *modules_of("worker")])
    assert django_side(loaded) == set()
    for package in ("core", "server", "pages"):
        assert ours(loaded, package) == set(), package


def test_the_wire_loads_nothing_else_of_ours():
    loaded = loaded_after_importing(modules_of("wire"))
    assert {m for m in loaded if m.startswith("relay.")} <= set(modules_of("wire")) | {"relay"}
    assert django_side(loaded) == set()


def test_the_core_loads_no_django_and_no_edges():
    loaded = loaded_after_importing(modules_of("core"))
    assert django_side(loaded) == set()
    for package in ("server", "pages", "worker"):
        assert ours(loaded, package) == set(), package


def test_the_server_edges_load_neither_the_pages_nor_the_worker():
    loaded = loaded_after_importing(modules_of("server"), django=True)
    assert ours(loaded, "pages") == set()
    assert ours(loaded, "worker") == set()
