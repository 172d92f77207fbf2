#!/usr/bin/env bash
# .ci/pythons.sh - build a venv for each newer Python agentenv.py claims (3.12 and 3.13, from
# pyenv), holding agentenv.py's run-time dependencies and what test_agentenv.py needs, so .ci/run
# can run the component suite on each: the project says Python 3.11 and newer, and the rest of
# the suite runs on 3.11 alone.
#
#   1. venv      $(pyenv root)/versions/<V>/bin/python -m venv $ROOT/py<V>
#                (re-created when it exists but its python does not run)
#   2. install   aiohttp pyyaml docker prometheus-client (run time) pytest hypothesis mcp
#                websockets (the component suite and its harness)
#   3. marker    $ROOT/py<V>/.agentenv-pythons-complete, once both steps passed
#
# Idempotent: with the marker present and the venv working it only checks (a second). Prints each
# venv's python on stdout, one a line, for .ci/run to use. Takes ~40 s a venv from scratch.
#
# Environment knobs:
#   AGENTENV_PYTHONS       the versions (default "3.12.1 3.13.0", pyenv's names)
#   AGENTENV_PYTHONS_ROOT  where the venvs go (default $HOME/.cache/agentenv-tests)
set -euo pipefail

VERSIONS=${AGENTENV_PYTHONS:-"3.12.1 3.13.0"}
ROOT=${AGENTENV_PYTHONS_ROOT:-$HOME/.cache/agentenv-tests}
PACKAGES=(aiohttp pyyaml docker prometheus-client pytest hypothesis 'mcp>=1.25,<2' websockets)

if command -v pyenv >/dev/null 2>&1; then PYENV_ROOT_DIR=$(pyenv root); else
    PYENV_ROOT_DIR=${PYENV_ROOT:-$HOME/.pyenv}; fi
mkdir -p "$ROOT"
for version in $VERSIONS; do
    base=$PYENV_ROOT_DIR/versions/$version/bin/python
    venv=$ROOT/py$version
    marker=$venv/.agentenv-pythons-complete
    if [ ! -x "$base" ]; then
        echo "[pythons] FAILED: Python $version is missing at $base; pyenv install $version" >&2
        exit 1
    fi
    exec 9>"$venv.lock"
    flock 9                          # one build at a time, whoever else runs this
    if [ -f "$marker" ] && "$venv/bin/python" -c 'import aiohttp, pytest, mcp' 2>/dev/null; then
        echo "[pythons] $version ready at $venv" >&2
    else
        started=$EPOCHREALTIME
        [ -x "$venv/bin/python" ] && "$venv/bin/python" -c '' 2>/dev/null || rm -rf "$venv"
        "$base" -m venv "$venv"
        "$venv/bin/pip" install -q --disable-pip-version-check "${PACKAGES[@]}" \
            >"$venv.pip.log" 2>&1 || { tail -n 40 "$venv.pip.log" >&2
                echo "[pythons] FAILED: pip could not install into $venv" >&2; exit 1; }
        touch "$marker"
        echo "[pythons] $version built at $venv in $(awk -v a="$started" -v b="$EPOCHREALTIME" \
            'BEGIN { printf "%.0f", b - a }')s" >&2
    fi
    exec 9>&-
    echo "$venv/bin/python"
done
