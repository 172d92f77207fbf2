#!/usr/bin/env bash
# .ci/framework-venv.sh - build the Python venv holding the REAL agentenv-framework 0.9.1364
# (AgentEnv, import agent_env) that the differential test tests/test_agent_framework_diff.py
# plays the agent-sandbox spec's worked examples through, beside agentenv.py's serve.
#
# The spec (agentenv-agent-sandbox.md) was measured on this version with Python 3.11:
#
#   1. venv      $(pyenv root)/versions/3.11.x/bin/python -m venv $VENV (the newest 3.11 pyenv has;
#                re-created when it exists but its python does not run)
#   2. install   pip install agentenv-framework==0.9.1364 (it pins agentenv-framework-protocol
#                0.1.379, which the spec names too); ~380 MB
#   3. check     pip check; the versions; agent_env's Episode API imports
#   4. marker    $VENV/.agentenv-framework-complete, written only once all of the above passed
#
# Idempotent: with the marker present and the venv still working it only re-checks (a few
# seconds). A half-built venv (no marker) is resumed: pip skips what is already installed.
# Takes ~2 minutes from scratch. Nothing here is needed at test time but the venv: the test
# runs the framework offline, in a network namespace of its own.
#
# Environment knobs:
#   AGENTENV_FRAMEWORK_VENV    the venv path (default $HOME/.cache/agentenv-tests/agentenv-framework-0.9.1364)
#   AGENTENV_FRAMEWORK_FORCE=1 delete the venv first and rebuild it from scratch
set -euo pipefail

FRAMEWORK_VERSION=0.9.1364
PROTOCOL_VERSION=0.1.379
PY_SERIES=3.11
VENV=${AGENTENV_FRAMEWORK_VENV:-$HOME/.cache/agentenv-tests/agentenv-framework-$FRAMEWORK_VERSION}
MARKER=$VENV/.agentenv-framework-complete

T_START=$EPOCHREALTIME
secs() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
step_begin() { STEP=$1; T_STEP=$EPOCHREALTIME; }
step_done()  { printf '[framework-venv] %-9s %6ss  %s\n' "$STEP" "$(secs "$T_STEP")" "$1"; }
die()        { printf '[framework-venv] FAILED in step %s: %s\n' "${STEP:-?}" "$*" >&2; exit 1; }

# --- the interpreter ---------------------------------------------------------
STEP=python
if command -v pyenv >/dev/null 2>&1; then
    PYENV_ROOT_DIR=$(pyenv root)
else
    PYENV_ROOT_DIR=${PYENV_ROOT:-$HOME/.pyenv}
fi
BASE_PY=$(ls -d "$PYENV_ROOT_DIR"/versions/$PY_SERIES.*/bin/python 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$BASE_PY" ] || ! "$BASE_PY" -c 'import venv, ssl' >/dev/null 2>&1; then
    die "no Python $PY_SERIES with venv and ssl modules under $PYENV_ROOT_DIR/versions; agentenv-framework $FRAMEWORK_VERSION was measured on $PY_SERIES: install one with pyenv install $PY_SERIES"
fi

mkdir -p "$(dirname "$VENV")"
# One build at a time: two test runs starting together must not both pip into the venv.
exec 9>"$VENV.lock"
if ! flock -n 9; then
    echo "[framework-venv] another framework-venv.sh is building $VENV; waiting for it"
    flock 9
fi

venv_python_works() { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; }

# Everything that must hold for the venv to count as ready. Prints why not on failure.
check_venv() {
    "$VENV/bin/python" - "$FRAMEWORK_VERSION" "$PROTOCOL_VERSION" <<'PY' || return 1
import importlib.metadata as md, sys
for dist, want in (("agentenv-framework", sys.argv[1]), ("agentenv-framework-protocol", sys.argv[2])):
    if (have := md.version(dist)) != want:
        sys.exit(f"{dist} {have} is installed, not {want}")
from agent_env.bundle.run import prepare_bundle, run_bundle  # noqa: F401
from agent_env.task.episode import EpisodeSpec  # noqa: F401
PY
}

if [ "${AGENTENV_FRAMEWORK_FORCE:-0}" = 1 ]; then
    rm -rf "$VENV"
fi

# --- fast path: already complete ------------------------------------------------
if [ -f "$MARKER" ]; then
    step_begin check
    if venv_python_works && check_venv; then
        step_done "already complete: $(head -1 "$MARKER")"
        exit 0
    fi
    step_done "the marker is there but the venv fails its check: rebuilding"
    rm -f "$MARKER"
fi

# --- 1. venv ---------------------------------------------------------------------
step_begin venv
if [ -e "$VENV" ] && ! venv_python_works; then
    rm -rf "$VENV"
    how="re-created (the old one's python did not run)"
elif [ -e "$VENV" ]; then
    how="reused a half-built venv (no marker): resuming"
else
    how="created"
fi
if [ ! -e "$VENV" ]; then
    "$BASE_PY" -m venv "$VENV" || die "$BASE_PY -m venv $VENV failed"
fi
step_done "$how with $("$VENV/bin/python" --version 2>&1) at $VENV"

PIP=("$VENV/bin/python" -m pip)

# --- 2. install ------------------------------------------------------------------
step_begin install
"${PIP[@]}" install "agentenv-framework==$FRAMEWORK_VERSION" ||
    die "pip install of agentenv-framework $FRAMEWORK_VERSION failed (no network or no index?)"
step_done "agentenv-framework $FRAMEWORK_VERSION"

# --- 3. check --------------------------------------------------------------------
step_begin check
"${PIP[@]}" check || die "pip check found broken requirements"
check_venv || die "the installed venv does not import agent_env's Episode API"
step_done "pip check clean; agent_env's Episode API and run_bundle load"

# --- 4. marker -------------------------------------------------------------------
{
    echo "agentenv-framework $FRAMEWORK_VERSION on $("$VENV/bin/python" --version 2>&1), built $(date -u +%FT%TZ) in $(secs "$T_START")s"
    "${PIP[@]}" freeze 2>/dev/null
} >"$MARKER.tmp"
mv "$MARKER.tmp" "$MARKER"
printf '[framework-venv] complete in %ss: %s (%s)\n' "$(secs "$T_START")" "$VENV" "$(du -sh "$VENV" | cut -f1)"
