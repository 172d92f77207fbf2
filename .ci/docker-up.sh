#!/usr/bin/env bash
# .ci/docker-up.sh - make sure a working Docker engine and a local
# `python:3.11-slim` image exist on this (Debian 12, root, no systemd,
# no container registry) CI machine.
#
#   1. apt-get install docker.io + debootstrap      (only if missing)
#   2. start dockerd in the background by hand       (only if no daemon answers)
#   3. provide python:3.11-slim without a registry   (only if the tag is absent):
#      load it from our cached tarball, or debootstrap Debian bookworm with
#      python3 and `docker import` the root filesystem, then cache it
#   4. smoke-test: run --rm, and a published port answering HTTP
#
# Idempotent: a second run on the same machine skips everything except the
# smoke tests. State (daemon log, pidfile, image cache) lives in
# /var/tmp/agentenv-ci/. Stop the daemon with .ci/docker-down.sh.
#
# Environment knobs:
#   AGENTENV_CI_STATE   state directory          (default /var/tmp/agentenv-ci)
#   DEBIAN_MIRROR       mirror for debootstrap    (default: taken from apt sources)
set -euo pipefail

STATE=${AGENTENV_CI_STATE:-/var/tmp/agentenv-ci}
DLOG=$STATE/dockerd.log
DPID=$STATE/dockerd.pid
IMAGE=python:3.11-slim
CACHE=$STATE/python-3.11-slim.image.tar.gz
ROOTFS=$STATE/python-rootfs
VERIFY_NAME=agentenv-ci-verify-$$
export DEBIAN_FRONTEND=noninteractive

T_START=$EPOCHREALTIME
secs() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
# step_begin NAME ; ... ; step_done "what happened"
step_begin() { STEP=$1; T_STEP=$EPOCHREALTIME; }
step_done()  { printf '[docker-up] %-14s %6ss  %s\n' "$STEP" "$(secs "$T_STEP")" "$1"; }
note()       { printf '[docker-up]                         %s\n' "$*"; }
# Every docker call is bounded: a wedged daemon must fail CI, not hang it.
dk()         { timeout -k 5 "${DK_TIMEOUT:-180}" docker "$@"; }
die()        { printf '[docker-up] FAILED in step %s: %s\n' "${STEP:-?}" "$*" >&2; exit 1; }

cleanup() {
    dk rm -f "$VERIFY_NAME" >/dev/null 2>&1 || true
    unmount_under "$ROOTFS" 2>/dev/null || true
}
trap cleanup EXIT

# Lazily unmount anything mounted below $1 (debootstrap mounts proc/sys in the
# target; if it dies half way those mounts must go before any rm -rf).
unmount_under() {
    local root=$1 m
    [ -d "$root" ] || return 0
    root=$(readlink -f "$root")
    awk -v r="$root/" 'index($2 "/", r) == 1 { print $2 }' /proc/self/mounts | sort -r |
        while read -r m; do umount -l "$m" || true; done
}

# The Debian mirror serving bookworm, read from the machine's apt sources
# (deb822 *.sources stanzas first, then one-line *.list entries).
debian_mirror() {
    local uri=""
    if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
    shopt -s nullglob
    local srcs=(/etc/apt/sources.list.d/*.sources) lists=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list)
    shopt -u nullglob
    if [ ${#srcs[@]} -gt 0 ]; then
        uri=$(awk '
            function flush() { if (has_suite && u != "" && out == "") out = u; u = ""; has_suite = 0 }
            FNR == 1          { flush() }
            /^[ \t]*$/        { flush(); next }
            /^[ \t]*#/        { next }
            /^URIs:/          { u = $2 }
            /^Suites:/        { for (i = 2; i <= NF; i++) if ($i == "bookworm") has_suite = 1 }
            END               { flush(); if (out != "") print out }
        ' "${srcs[@]}")
    fi
    if [ -z "$uri" ]; then
        uri=$(cat "${lists[@]}" 2>/dev/null | awk '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                if ($(i + 1) == "bookworm") { print $i; exit }
            }')
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

# Does the image give python 3.11 with the modules the project relies on?
image_ok() {
    DK_TIMEOUT=60 dk run --rm --network none "$IMAGE" python -c '
import sys, ssl, sqlite3, json, http.server
assert sys.version_info[:2] == (3, 11), sys.version
print(sys.version.split()[0])' 2>&1
}

[ "$(id -u)" = 0 ] || { echo "docker-up.sh must run as root" >&2; exit 1; }
mkdir -p "$STATE"
# Serialise concurrent runs (several sessions may call this at once).
# (fd 9 must not leak into the long-lived dockerd, or it would hold the lock forever.)
exec 9>"$STATE/up.lock"
flock -w 900 9 || die "another docker-up.sh holds $STATE/up.lock"

# ---- 1. packages -----------------------------------------------------------
step_begin packages
installed() { [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]; }
missing=()
for p in docker.io debootstrap; do installed "$p" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$STATE/apt-install.log" 2>&1 ||
        { tail -20 "$STATE/apt-install.log" >&2; die "apt-get install ${missing[*]}"; }
    step_done "installed ${missing[*]}"
else
    step_done "docker.io and debootstrap already installed"
fi

# ---- 2. daemon -------------------------------------------------------------
step_begin dockerd
# Bounded: a request stuck in the daemon must not hang this poll.
daemon_answers() { DK_TIMEOUT=10 dk info >/dev/null 2>&1; }
our_pid_alive() {
    local p
    p=$(cat "$DPID" 2>/dev/null) || return 1
    [ -n "$p" ] && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = dockerd ]
}
if daemon_answers; then
    step_done "a daemon already answers (reused)"
else
    if our_pid_alive; then
        note "dockerd $(cat "$DPID") (ours) is running but not answering yet; waiting for it"
    else
        [ -f "$DLOG" ] && mv -f "$DLOG" "$DLOG.prev"   # keep the previous daemon's log
        setsid nohup dockerd >"$DLOG" 2>&1 </dev/null 9>&- &
        echo $! >"$DPID"
    fi
    pid=$(cat "$DPID")
    deadline=$((SECONDS + 30))
    until daemon_answers; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -25 "$DLOG" >&2
            die "dockerd (pid $pid) exited; log: $DLOG"
        fi
        if [ $SECONDS -ge $deadline ]; then
            tail -25 "$DLOG" >&2
            die "dockerd (pid $pid) did not answer within 30 s; log: $DLOG"
        fi
        sleep 0.25
    done
    step_done "started dockerd pid $pid (log $DLOG)"
fi
note "$(dk info --format 'server {{.ServerVersion}}, storage {{.Driver}}, cgroup {{.CgroupDriver}} v{{.CgroupVersion}}')"

# ---- 3. python:3.11-slim stand-in -----------------------------------------
step_begin image
have_image() { dk image inspect "$IMAGE" >/dev/null 2>&1; }
how=""
if have_image; then
    how="$IMAGE already present"
elif [ -s "$CACHE" ]; then
    if gzip -t "$CACHE" 2>/dev/null && dk load -q -i "$CACHE" >/dev/null 2>&1 && have_image &&
        image_ok >/dev/null; then
        how="loaded from cache $CACHE"
    else
        note "cached image $CACHE is unusable; deleting it and rebuilding"
        dk rmi -f "$IMAGE" >/dev/null 2>&1 || true
        rm -f "$CACHE"
    fi
fi
if [ -z "$how" ]; then
    mirror=$(debian_mirror)
    note "building $IMAGE: debootstrap bookworm from $mirror (takes 1-2 min)"
    unmount_under "$ROOTFS"
    rm -rf --one-file-system "$ROOTFS"
    if ! timeout 1200 debootstrap --variant=minbase \
            --include=python3,python-is-python3,ca-certificates \
            bookworm "$ROOTFS" "$mirror" >"$STATE/debootstrap.log" 2>&1; then
        tail -25 "$STATE/debootstrap.log" >&2
        die "debootstrap failed; log: $STATE/debootstrap.log"
    fi
    unmount_under "$ROOTFS"
    # Drop apt's downloaded packages and indexes: not needed in the image.
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin \
           "$ROOTFS"/var/lib/apt/lists/*
    tar -C "$ROOTFS" --numeric-owner -c . |
        dk import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'CMD ["python3"]' \
            - "$IMAGE" >/dev/null
    rm -rf --one-file-system "$ROOTFS"
    how="built with debootstrap + docker import"
fi
# Keep a cache so a re-run (even after /var/lib/docker is wiped) avoids debootstrap.
if [ ! -s "$CACHE" ]; then
    dk save "$IMAGE" | gzip -1 >"$CACHE.tmp"
    mv -f "$CACHE.tmp" "$CACHE"
    how="$how; cached as $CACHE ($(du -h "$CACHE" | cut -f1))"
fi
step_done "$how"

# ---- 4. verification -------------------------------------------------------
step_begin verify-run
out=$(image_ok) || { echo "$out" >&2; die "$IMAGE cannot import ssl/sqlite3/json/http.server"; }
out2=$(DK_TIMEOUT=60 dk run --rm "$IMAGE" python -c 'import ssl,sqlite3; print("ok")') || die "docker run --rm failed"
[ "$out2" = ok ] || die "docker run --rm printed '$out2', expected 'ok'"
step_done "docker run --rm $IMAGE: python $out, ssl+sqlite3 ok"

step_begin verify-port
dk run -d --name "$VERIFY_NAME" -p 127.0.0.1::8000 -w /tmp "$IMAGE" \
    python -m http.server 8000 >/dev/null
hostport=$(dk port "$VERIFY_NAME" 8000/tcp | head -1)
[ -n "$hostport" ] || die "no host port published for 8000/tcp"
http_status() {   # prints the HTTP status line from 127.0.0.1:PORT, or nothing
    if command -v curl >/dev/null; then
        curl -s -o /dev/null -m 2 -w '%{http_code}' "http://$1/" || true
    else
        timeout 2 bash -c 'exec 3<>"/dev/tcp/${1%:*}/${1##*:}" && printf "GET / HTTP/1.0\r\n\r\n" >&3 &&
            head -1 <&3 | awk "{print \$2}"' _ "$1" 2>/dev/null || true
    fi
}
code=""
deadline=$((SECONDS + 10))
while [ $SECONDS -lt $deadline ]; do
    code=$(http_status "$hostport")
    [ "$code" = 200 ] && break
    sleep 0.2
done
if [ "$code" != 200 ]; then
    dk logs "$VERIFY_NAME" 2>&1 | tail -10 >&2
    die "http.server in a container did not answer on $hostport within 10 s (last status '${code}')"
fi
dk rm -f "$VERIFY_NAME" >/dev/null
step_done "container http.server answered HTTP 200 on $hostport; removed"

printf '[docker-up] all done in %ss\n' "$(secs "$T_START")"
