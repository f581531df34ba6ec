#!/usr/bin/env bash
# System packages the Python tests use beyond pip (the README's test command runs this before pytest).
#
#   bash scripts/test_deps.sh
#
# Headless Chromium (Debian: chromium) opens the HTML report in tests/report/test_report.py. Installed with
# apt-get (after apt-get update) when missing and running as root; elsewhere this names what to install
# and exits 0, and that test skips saying Chromium is missing.
set -euo pipefail

missing=()
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null \
  || command -v google-chrome-stable >/dev/null || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "test_deps: installing ${missing[*]} (apt-get)" >&2
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "test_deps: missing ${missing[*]}; install them (Debian/Ubuntu: apt-get install ${missing[*]})," \
       "or the tests that need them skip" >&2
fi
