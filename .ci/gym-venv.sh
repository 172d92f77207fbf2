#!/usr/bin/env bash
# .ci/gym-venv.sh - build the Python venv holding the REAL NeMo Gym 0.7.0 that the
# Gym tests (tests/test_gym*.py, helpers in tests/gym/) run against.
#
# nemo-gym 0.5.0 .. 0.7.0 declare Requires-Python >=3.13.14, and this machine's
# newest Python is pyenv 3.13.0, so no interpreter satisfies it. It installs and
# runs fine anyway when the floor is ignored:
#
#   1. venv      $(pyenv root)/versions/3.13.0/bin/python -m venv $VENV
#                (re-created when it exists but its python does not run)
#   2. download  pip download --no-deps --ignore-requires-python nemo-gym==0.7.0
#                (the wheel is kept in $VENV.wheels/ for re-runs)
#   3. install   pip install --ignore-requires-python <that wheel> aiohttp pyyaml docker
#                prometheus-client (agentenv.py's own run-time needs:
#                Gym runs our copied agentenv.py with this venv's python)
#   4. check     pip check; import nemo_gym and simple_agent; the `gym` CLI answers
#   5. marker    $VENV/.agentenv-gym-complete, written only once all of the above passed
#
# Idempotent: with the marker present and the venv still working it only
# re-checks (a few seconds). A half-built venv (no marker) is resumed: pip
# skips what is already installed. Takes ~5 minutes and ~1.4 GiB from scratch.
#
# Environment knobs:
#   AGENTENV_GYM_VENV    the venv path (default $HOME/.cache/agentenv-tests/nemo-gym-0.7)
#   AGENTENV_GYM_FORCE=1 delete the venv first and rebuild it from scratch
set -euo pipefail

GYM_VERSION=0.7.0
PY_VERSION=3.13.0
VENV=${AGENTENV_GYM_VENV:-$HOME/.cache/agentenv-tests/nemo-gym-0.7}
WHEELS=$VENV.wheels
MARKER=$VENV/.agentenv-gym-complete
EXTRA_PKGS=(aiohttp pyyaml docker prometheus-client)

T_START=$EPOCHREALTIME
secs() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
step_begin() { STEP=$1; T_STEP=$EPOCHREALTIME; }
step_done()  { printf '[gym-venv] %-9s %6ss  %s\n' "$STEP" "$(secs "$T_STEP")" "$1"; }
die()        { printf '[gym-venv] FAILED in step %s: %s\n' "${STEP:-?}" "$*" >&2; exit 1; }

# --- the interpreter ---------------------------------------------------------
STEP=python
if command -v pyenv >/dev/null 2>&1; then
    PYENV_ROOT_DIR=$(pyenv root)
else
    PYENV_ROOT_DIR=${PYENV_ROOT:-$HOME/.pyenv}
fi
BASE_PY=$PYENV_ROOT_DIR/versions/$PY_VERSION/bin/python
if [ ! -x "$BASE_PY" ] || ! "$BASE_PY" -c 'import venv, ssl' >/dev/null 2>&1; then
    die "Python $PY_VERSION is missing (looked for $BASE_PY, with venv and ssl modules). nemo-gym $GYM_VERSION needs a Python 3.13; install it with: pyenv install $PY_VERSION"
fi

mkdir -p "$(dirname "$VENV")"
# One build at a time: two test runs starting together must not both pip into the venv.
exec 9>"$VENV.lock"
if ! flock -n 9; then
    echo "[gym-venv] another gym-venv.sh is building $VENV; waiting for it"
    flock 9
fi

venv_python_works() { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; }

# Everything that must hold for the venv to count as ready. Prints why not on failure.
check_venv() {
    "$VENV/bin/python" - "$GYM_VERSION" <<'EOF' || return 1
import importlib.metadata as md, os, sys
want = sys.argv[1]
have = md.version("nemo-gym")
if have != want:
    sys.exit(f"nemo-gym {have} is installed, not {want}")
import nemo_gym, aiohttp, yaml, docker, prometheus_client  # noqa: F401
import responses_api_agents.simple_agent as sa
app = os.path.join(os.path.dirname(sa.__file__), "app.py")
if not os.path.isfile(app):
    sys.exit(f"simple_agent has no app.py at {app}")
EOF
    [ -x "$VENV/bin/gym" ] || { echo "no gym CLI at $VENV/bin/gym" >&2; return 1; }
}

if [ "${AGENTENV_GYM_FORCE:-0}" = 1 ]; then
    rm -rf "$VENV"
fi

# --- fast path: already complete ------------------------------------------------
if [ -f "$MARKER" ]; then
    step_begin check
    if venv_python_works && check_venv; then
        step_done "already complete: $(head -1 "$MARKER")"
        printf '[gym-venv] venv %s (%s)\n' "$VENV" "$(du -sh "$VENV" 2>/dev/null | cut -f1)"
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

# --- 2. download -----------------------------------------------------------------
step_begin download
WHEEL=$WHEELS/nemo_gym-$GYM_VERSION-py3-none-any.whl
if [ -f "$WHEEL" ] && "$VENV/bin/python" -m zipfile -t "$WHEEL" >/dev/null 2>&1; then
    step_done "kept $WHEEL"
else
    rm -rf "$WHEELS"; mkdir -p "$WHEELS"
    "${PIP[@]}" download --no-deps --ignore-requires-python -d "$WHEELS" "nemo-gym==$GYM_VERSION" ||
        die "could not download nemo-gym==$GYM_VERSION (no network or no index?)"
    [ -f "$WHEEL" ] || die "pip download did not produce $WHEEL: $(ls "$WHEELS")"
    step_done "$(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
fi

# --- 3. install ------------------------------------------------------------------
step_begin install
"${PIP[@]}" install --ignore-requires-python "$WHEEL" "${EXTRA_PKGS[@]}" ||
    die "pip install of nemo-gym $GYM_VERSION failed"
step_done "nemo-gym $GYM_VERSION + ${EXTRA_PKGS[*]}"

# --- 4. check --------------------------------------------------------------------
step_begin check
"${PIP[@]}" check || die "pip check found broken requirements"
check_venv || die "the installed venv does not import nemo_gym / simple_agent"
"$VENV/bin/gym" --help >/dev/null 2>&1 || die "$VENV/bin/gym --help fails"
step_done "pip check clean; nemo_gym, simple_agent and the gym CLI load"

# --- 5. marker -------------------------------------------------------------------
{
    echo "nemo-gym $GYM_VERSION on $("$VENV/bin/python" --version 2>&1), built $(date -u +%FT%TZ) in $(secs "$T_START")s"
    "${PIP[@]}" freeze 2>/dev/null
} >"$MARKER.tmp"
mv "$MARKER.tmp" "$MARKER"
printf '[gym-venv] complete in %ss: %s (%s)\n' "$(secs "$T_START")" "$VENV" "$(du -sh "$VENV" | cut -f1)"
