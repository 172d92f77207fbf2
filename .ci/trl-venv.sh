#!/usr/bin/env bash
# .ci/trl-venv.sh - build the Python venv holding the REAL TRL 1.16.0 (its GRPOTrainer, on the CPU)
# that tests/test_trl.py trains through agentenv.trl_environment with, as a user would.
#
#   1. venv      $(pyenv root)/versions/3.11.x/bin/python -m venv $VENV (the newest 3.11 pyenv has:
#                the CPU wheel of torch on this machine's disk is for 3.11; re-created when it
#                exists but its python does not run)
#   2. torch     pip install torch==2.13.0 alone first: for that exact pin pip takes the CPU wheel
#                (about 750 MB installed, ~25 s); a bare `torch`, or a range a newer release
#                satisfies, resolves to a CUDA build of several GB. Once it is there, trl's own
#                range for torch installs nothing more.
#   3. install   trl, transformers, datasets, tokenizers at the pins below, torch held at its pin,
#                and agentenv.py's own run-time needs (aiohttp, pyyaml, docker, prometheus-client):
#                the training script imports agentenv from this checkout with this venv's python
#   4. check     pip check; the versions; torch is a CPU build; GRPOTrainer and the Qwen3 chat
#                template TRL recognises import
#   5. marker    $VENV/.agentenv-trl-complete, written only once all of the above passed
#
# Idempotent: with the marker present and the venv still working it only re-checks (~15 s: torch's
# import is most of it). A half-built venv (no marker) is resumed: pip skips what is already
# installed. Takes ~2 minutes and ~1.7 GB from scratch. Nothing is needed at test time but the
# venv: the test builds its tiny model and tokenizer itself, and downloads nothing.
#
# Environment knobs:
#   AGENTENV_TRL_VENV    the venv path (default $HOME/.cache/agentenv-tests/trl-1.16.0)
#   AGENTENV_TRL_FORCE=1 delete the venv first and rebuild it from scratch
set -euo pipefail

TRL_VERSION=1.16.0
TORCH_VERSION=2.13.0
TRANSFORMERS_VERSION=5.24.0
DATASETS_VERSION=5.2.0
TOKENIZERS_VERSION=0.23.3
PY_SERIES=3.11
VENV=${AGENTENV_TRL_VENV:-$HOME/.cache/agentenv-tests/trl-$TRL_VERSION}
MARKER=$VENV/.agentenv-trl-complete
AGENTENV_PKGS=(aiohttp pyyaml docker prometheus-client)

T_START=$EPOCHREALTIME
secs() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
step_begin() { STEP=$1; T_STEP=$EPOCHREALTIME; }
step_done()  { printf '[trl-venv] %-9s %6ss  %s\n' "$STEP" "$(secs "$T_STEP")" "$1"; }
die()        { printf '[trl-venv] FAILED in step %s: %s\n' "${STEP:-?}" "$*" >&2; exit 1; }

# --- the interpreter ---------------------------------------------------------
STEP=python
if command -v pyenv >/dev/null 2>&1; then
    PYENV_ROOT_DIR=$(pyenv root)
else
    PYENV_ROOT_DIR=${PYENV_ROOT:-$HOME/.pyenv}
fi
BASE_PY=$(ls -d "$PYENV_ROOT_DIR"/versions/$PY_SERIES.*/bin/python 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$BASE_PY" ] || ! "$BASE_PY" -c 'import venv, ssl' >/dev/null 2>&1; then
    die "no Python $PY_SERIES with venv and ssl modules under $PYENV_ROOT_DIR/versions; torch $TORCH_VERSION's CPU wheel here is for $PY_SERIES: install one with pyenv install $PY_SERIES"
fi

mkdir -p "$(dirname "$VENV")"
# One build at a time: two test runs starting together must not both pip into the venv.
exec 9>"$VENV.lock"
if ! flock -n 9; then
    echo "[trl-venv] another trl-venv.sh is building $VENV; waiting for it"
    flock 9
fi

venv_python_works() { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; }

# Everything that must hold for the venv to count as ready. Prints why not on failure.
check_venv() {
    "$VENV/bin/python" - "$TRL_VERSION" "$TORCH_VERSION" "$TRANSFORMERS_VERSION" "$DATASETS_VERSION" \
        "$TOKENIZERS_VERSION" <<'PY' || return 1
import importlib.metadata as md, sys
for dist, want in zip(("trl", "torch", "transformers", "datasets", "tokenizers"), sys.argv[1:]):
    have = md.version(dist)
    if have.split("+")[0] != want:
        sys.exit(f"{dist} {have} is installed, not {want}")
import torch
if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} is a CUDA build (CUDA {torch.version.cuda}), not the CPU wheel")
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
from trl.chat_template_utils import qwen3_chat_template  # noqa: F401
import aiohttp, yaml, docker, prometheus_client  # noqa: F401
PY
}

if [ "${AGENTENV_TRL_FORCE:-0}" = 1 ]; then
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

# --- 2. torch --------------------------------------------------------------------
step_begin torch
"${PIP[@]}" install "torch==$TORCH_VERSION" ||
    die "pip install torch==$TORCH_VERSION failed (no network or no index?)"
step_done "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"

# --- 3. install ------------------------------------------------------------------
step_begin install
"${PIP[@]}" install "torch==$TORCH_VERSION" "trl==$TRL_VERSION" "transformers==$TRANSFORMERS_VERSION" \
    "datasets==$DATASETS_VERSION" "tokenizers==$TOKENIZERS_VERSION" "${AGENTENV_PKGS[@]}" ||
    die "pip install of trl $TRL_VERSION and its stack failed"
step_done "trl $TRL_VERSION, transformers $TRANSFORMERS_VERSION, datasets $DATASETS_VERSION, tokenizers $TOKENIZERS_VERSION + ${AGENTENV_PKGS[*]}"

# --- 4. check --------------------------------------------------------------------
step_begin check
"${PIP[@]}" check || die "pip check found broken requirements"
check_venv || die "the installed venv does not import TRL's GRPOTrainer on a CPU torch"
step_done "pip check clean; GRPOTrainer imports on a CPU torch"

# --- 5. marker -------------------------------------------------------------------
{
    echo "trl $TRL_VERSION, torch $TORCH_VERSION (CPU) on $("$VENV/bin/python" --version 2>&1), built $(date -u +%FT%TZ) in $(secs "$T_START")s"
    "${PIP[@]}" freeze 2>/dev/null
} >"$MARKER.tmp"
mv "$MARKER.tmp" "$MARKER"
printf '[trl-venv] complete in %ss: %s (%s)\n' "$(secs "$T_START")" "$VENV" "$(du -sh "$VENV" | cut -f1)"
