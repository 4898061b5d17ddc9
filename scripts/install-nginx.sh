#!/usr/bin/env bash
# Install Debian's nginx for the reverse-proxy tests (tests/test_deploy_proxies.py); needs root or sudo.
# The package's service is not started: the tests run their own nginx in the foreground.
# When nginx cannot be installed this prints why and exits 0, so local runs skip those tests
# (under CI=true the tests themselves fail when nginx is missing).
set -euo pipefail
if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then exit 0; fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "nginx is missing and this user cannot install it; nginx tests will be skipped" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "nginx is missing and apt-get is not available; nginx tests will be skipped" >&2
  exit 0
fi
# Keep the package's postinst from starting a system nginx on port 80 (the tests want none).
cleanup=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod 755 /usr/sbin/policy-rc.d
  cleanup="$SUDO rm -f /usr/sbin/policy-rc.d"
  trap '$cleanup' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -q >/dev/null \
  && $SUDO apt-get install -y -q --no-install-recommends nginx >/dev/null; }; then
  echo "installing nginx with apt-get failed; nginx tests will be skipped" >&2
  exit 0
fi
echo "installed $(/usr/sbin/nginx -v 2>&1)"
