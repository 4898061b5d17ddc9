#!/usr/bin/env bash
# Install Debian's Chromium and ChromeDriver for the browser tests (needs root or sudo).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then exit 0; fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "chromium is missing and this user cannot install it; browser tests will be skipped" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null
echo "installed $(chromium --version)"
