"""Probing a patch before it is applied: are the private names it relies on still there,
and are the installed versions the ones the test suite ran against."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

#: The versions the patches were written and tested against.
TESTED: dict[str, frozenset[str]] = {
    "daphne": frozenset({"4.2.3"}),
    "twisted": frozenset({"26.10.0"}),
    "autobahn": frozenset({"26.10.2"}),
}


@dataclass(frozen=True)
class Patch:
    """One change to daphne's stack: what it gives, what it needs, how to apply it."""

    name: str
    #: Which of :data:`TESTED`'s packages it changes or relies on.
    packages: tuple[str, ...]
    #: Every private name it replaces or reads: ``"module:Class.attribute"`` (or
    #: ``"module:attribute"``). An attribute that instances set (in ``__init__``) is
    #: found in its class's source.
    targets: tuple[str, ...]
    apply: Callable[[], None]


def missing_targets(targets: Iterable[str]) -> list[str]:
    """The targets that no longer exist in the installed packages."""
    missing = []
    for target in targets:
        module_name, _, path = target.partition(":")
        try:
            owner: object = importlib.import_module(module_name)
        except ImportError:
            missing.append(target)
            continue
        *parents, attribute = path.split(".")
        found = True
        for part in parents:
            owner = getattr(owner, part, None)
            if owner is None:
                found = False
                break
        if not found or not _has(owner, attribute):
            missing.append(target)
    return missing


def _has(owner: object, attribute: str) -> bool:
    if hasattr(owner, attribute):
        return True
    if not inspect.isclass(owner):
        return False
    for klass in owner.__mro__:  # an instance attribute: set somewhere in the class
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if f"self.{attribute}" in source:
            return True
    return False


def untested_versions(packages: Iterable[str]) -> list[str]:
    """``package version`` for each of ``packages`` installed at an untested version."""
    out = []
    for package in packages:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "(not installed)"
        if version not in TESTED.get(package, frozenset()):
            out.append(f"{package} {version}")
    return out


def problem(patch: Patch, *, skip: Iterable[str] = (), untested: str = "skip") -> str | None:
    """Why ``patch`` must not be applied here, or None. ``skip``: patch names an operator
    left out (``all`` for every one); ``untested="apply"`` applies a patch on package
    versions outside :data:`TESTED` anyway."""
    skip = set(skip)
    if "all" in skip or patch.name in skip:
        return "DAPHNE_SHIM_SKIP"
    missing = missing_targets(patch.targets)
    if missing:
        return "not found: " + ", ".join(missing)
    versions = untested_versions(patch.packages)
    if versions and untested != "apply":
        return (
            "untested version: " + ", ".join(versions) + " (DAPHNE_SHIM_UNTESTED=apply applies it)"
        )
    return None
