"""The worker as a package (SPEC §22): the wheel the relay builds itself agrees with the
one ``make worker-wheel`` builds with the pinned backend, holds only what ships to a
GPU box, and is served at ``/setup``; ``worker.py`` and ``python -m relay.worker`` are
the same program."""

from __future__ import annotations

import email.parser
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from relay.pages import bundle, wheel

ROOT = Path(__file__).resolve().parents[2]


def members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def metadata(files: dict[str, bytes], name: str) -> dict[str, list[str]]:
    parsed = email.parser.BytesParser().parsebytes(files[name])
    fields: dict[str, list[str]] = {}
    for key, value in parsed.items():
        fields.setdefault(key, []).append(value)
    return fields


def test_the_relays_wheel_holds_the_shipped_modules_and_a_valid_record():
    built = wheel.build()
    assert built.filename == wheel.wheel_filename()
    assert built.filename.startswith("modelrelay_worker-") and built.filename.endswith(
        "-py3-none-any.whl"
    )
    files = members(built.data)
    modules = {n for n in files if not n.startswith(wheel.project().dist_info)}
    assert modules == set(bundle.package_sources())
    assert "relay/worker/__main__.py" in modules and "relay/worker/daemon.py" in modules
    assert not any(n.startswith(("relay/server", "relay/core", "relay/pages")) for n in files)
    assert not any(n in ("worker.py", "manage.py") for n in files)
    info = wheel.project().dist_info
    record = files[f"{info}/RECORD"].decode().splitlines()
    assert record[-1] == f"{info}/RECORD,,"
    recorded = {line.split(",")[0]: line.split(",") for line in record[:-1]}
    assert set(recorded) == set(files) - {f"{info}/RECORD"}
    for name, (_, digest, size) in recorded.items():
        assert digest == wheel._record_hash(files[name]) and int(size) == len(files[name])
    assert wheel.build().data == built.data  # reproducible


def test_the_wheel_requires_exactly_the_workers_pins():
    files = members(wheel.build().data)
    fields = metadata(files, f"{wheel.project().dist_info}/METADATA")
    requires = fields["Requires-Dist"]
    pinned = wheel.requirements(bundle.REQUIREMENTS.read_text())
    assert requires == list(pinned)
    assert not any(r.lower().startswith(("django", "channels", "daphne")) for r in requires)
    assert fields["Name"] == ["modelrelay-worker"]
    assert fields["Requires-Python"] == [">=3.11"]
    entry = files[f"{wheel.project().dist_info}/entry_points.txt"].decode()
    assert "modelrelay-worker = relay.worker.daemon:main" in entry


@pytest.mark.live  # runs pip, which builds with setuptools from the package index
def test_the_pinned_build_backend_builds_the_same_wheel(tmp_path):
    """``make worker-wheel``'s build: pip with the backend pyproject.toml pins."""
    source = tmp_path / "src"
    # A copy of the tree's packaging inputs: the build writes build/ and *.egg-info.
    for name in ("pyproject.toml", "requirements-worker.txt", "relay/__init__.py"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((ROOT / name).read_bytes())
    for arcname, path in bundle.package_sources().items():
        (source / arcname).parent.mkdir(parents=True, exist_ok=True)
        (source / arcname).write_bytes(path.read_bytes())
    for package in ("core", "server", "pages"):  # present in a checkout, never packaged
        (source / "relay" / package).mkdir()
        (source / "relay" / package / "__init__.py").write_text("")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", source],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (theirs,) = (tmp_path / "dist").glob("*.whl")
    ours = wheel.build()
    assert theirs.name == ours.filename
    their_files, our_files = members(theirs.read_bytes()), members(ours.data)
    info = wheel.project().dist_info
    assert {n for n in their_files if not n.startswith(info)} == {
        n for n in our_files if not n.startswith(info)
    }
    for name in their_files:
        if not name.startswith(info):
            assert their_files[name] == our_files[name], name
    theirs_meta = metadata(their_files, f"{info}/METADATA")
    ours_meta = metadata(our_files, f"{info}/METADATA")
    for field in ("Name", "Version", "Summary", "Requires-Python", "Requires-Dist"):
        assert theirs_meta.get(field) == ours_meta.get(field), field
    scripts = [
        line
        for line in their_files[f"{info}/entry_points.txt"].decode().splitlines()
        if " = " in line
    ]
    assert scripts == ["modelrelay-worker = relay.worker.daemon:main"]
    assert scripts[0] in our_files[f"{info}/entry_points.txt"].decode()


@pytest.mark.django_db
def test_the_relay_serves_the_wheel_at_setup():
    from django.test import Client

    built = wheel.worker_wheel()
    response = Client().get(f"/setup/{built.filename}")
    assert response.status_code == 200
    assert response.content == built.data
    assert response["Content-Disposition"] == f'attachment; filename="{built.filename}"'
    assert Client().get("/setup/modelrelay_worker-0.0.1-py3-none-any.whl").status_code == 404


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["worker.py"], "worker.py"),
        (["-m", "relay.worker"], "python -m relay.worker"),
    ],
)
def test_worker_py_and_python_m_relay_worker_are_the_same_program(argv, prog):
    result = subprocess.run(
        [sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {prog} ")
    assert "--join-token" in result.stdout and "--state-dir" in result.stdout
