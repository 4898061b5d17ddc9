#!/usr/bin/env bash
# Install a Debian package a test or benchmark needs: install-deb.sh PACKAGE [BINARY] [PURPOSE]
# (nginx and caddy for the reverse-proxy tests, wrk for make bench, prometheus for promtool).
# Needs root or sudo.
# A package's own service is never started: the tests run their own process in the foreground.
# When the package cannot be installed this prints why and exits 0, so local runs skip what
# needs it (under CI=true the tests themselves fail when it is missing).
set -euo pipefail
package=$1
binary=${2:-$1}
purpose=${3:-$package tests will be skipped}
if command -v "$binary" >/dev/null 2>&1 || [ -x "/usr/sbin/$binary" ] || [ -x "/usr/bin/$binary" ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "$package is missing and this user cannot install it; $purpose" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "$package is missing and apt-get is not available; $purpose" >&2
  exit 0
fi
# Keep the package's postinst from starting a system service (nginx on port 80, caddy on 80/2019).
cleanup=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod 755 /usr/sbin/policy-rc.d
  cleanup="$SUDO rm -f /usr/sbin/policy-rc.d"
  trap '$cleanup' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get install -y -q --no-install-recommends "$package" >/dev/null 2>&1; then
  if ! { $SUDO apt-get update -q >/dev/null \
    && $SUDO apt-get install -y -q --no-install-recommends "$package" >/dev/null; }; then
    echo "installing $package with apt-get failed; $purpose" >&2
    exit 0
  fi
fi
echo "installed $package"
