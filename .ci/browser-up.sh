#!/usr/bin/env bash
# .ci/browser-up.sh - make sure Debian's chromium is installed on this (Debian 12, root) CI
# machine, for the web page's browser test (tests/test_web.py). No browser build can be
# downloaded here (`playwright install` fails): Playwright's Python package, from the [test]
# extra, drives this chromium through executable_path.
#
#   1. apt-get install chromium   (only if /usr/bin/chromium is missing; apt-get update first)
#   2. check                      chromium --version answers
#
# Idempotent: a second run only checks (well under a second). Takes 15-30 s from scratch.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
T_START=$EPOCHREALTIME
secs() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

if [ -x /usr/bin/chromium ]; then
    echo "[browser-up] chromium is installed"
else
    echo "[browser-up] installing Debian's chromium"
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends chromium >/dev/null
fi
# the wrapper script prints a harmless "[: ... unexpected operator" on stderr: keep stdout only
version=$(/usr/bin/chromium --version 2>/dev/null) || {
    echo "[browser-up] FAILED: /usr/bin/chromium --version did not answer" >&2; exit 1; }
echo "[browser-up] $version ready in $(secs "$T_START")s"
