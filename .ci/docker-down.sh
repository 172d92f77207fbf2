#!/usr/bin/env bash
# .ci/docker-down.sh - stop the dockerd that .ci/docker-up.sh started, using
# the PID it recorded (never by process name). A daemon started by anything
# else is left alone. Images and the image cache are kept.
set -uo pipefail
STATE=${AGENTENV_CI_STATE:-/var/tmp/agentenv-ci}
DPID=$STATE/dockerd.pid

pid=$(cat "$DPID" 2>/dev/null || true)
if [ -z "$pid" ]; then
    echo "[docker-down] no $DPID: docker-up.sh did not start a daemon; nothing to stop"
    exit 0
fi
if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != dockerd ]; then
    echo "[docker-down] pid $pid from $DPID is not a running dockerd; removing the stale pidfile"
    rm -f "$DPID"
    exit 0
fi

ids=$(timeout -k 2 20 docker ps -aq 2>/dev/null || true)
if [ -n "$ids" ]; then
    echo "[docker-down] removing $(echo "$ids" | wc -l) leftover container(s)"
    timeout -k 2 60 docker rm -f $ids >/dev/null || true
fi

kill -TERM "$pid"          # dockerd stops the containerd it spawned itself
for _ in $(seq 1 100); do  # up to 20 s
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
done
if kill -0 "$pid" 2>/dev/null; then
    echo "[docker-down] dockerd $pid still running after 20 s" >&2
    exit 1
fi
rm -f "$DPID"
echo "[docker-down] dockerd $pid stopped"
