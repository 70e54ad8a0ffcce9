#!/usr/bin/env bash
# A throwaway Redis Cluster on 127.0.0.1 for the remote tier's tests and demos.
#
#   scripts/redis_cluster.sh start [DIR]   start it (in DIR, or a new temp dir); prints
#                                          REDIS_CLUSTER_DIR=... and REDIS_CLUSTER_URL=...
#                                          (eval-able; the URL lists every master as a seed)
#   scripts/redis_cluster.sh stop DIR      stop every server started in DIR (by pid), remove DIR
#
# Env: REDIS_CLUSTER_MASTERS (3), REDIS_CLUSTER_REPLICAS per master (0),
#      REDIS_CLUSTER_PASSWORD (none; sets requirepass and masterauth),
#      REDIS_CLUSTER_NODE_TIMEOUT_MS (2000; how soon a dead master fails over),
#      REDIS_CLUSTER_MAXMEMORY (256mb, evicting allkeys-lru: the tier is a cache).
# Uses Debian's redis-server and redis-cli (scripts/setup.sh installs them). Ports are picked
# free below the ephemeral range (the cluster bus needs port+10000 free too). A failed start
# stops what it started.
set -euo pipefail

MASTERS="${REDIS_CLUSTER_MASTERS:-3}"
REPLICAS="${REDIS_CLUSTER_REPLICAS:-0}"
PASSWORD="${REDIS_CLUSTER_PASSWORD:-}"
NODE_TIMEOUT="${REDIS_CLUSTER_NODE_TIMEOUT_MS:-2000}"
MAXMEMORY="${REDIS_CLUSTER_MAXMEMORY:-256mb}"

die() { echo "redis_cluster.sh: $*" >&2; exit 1; }

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Both a node's port and its bus port (port+10000) stay below the kernel's ephemeral range:
# a port there may be held by an outgoing connection, which no connect test sees but which
# makes the server's bind fail.
EPHEMERAL_LOW="$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)"
PORT_SPAN=$((EPHEMERAL_LOW - 20000))
((PORT_SPAN >= 1000)) || die "ephemeral ports start at $EPHEMERAL_LOW; need room below for ports and bus ports"

free_port() {
    local p
    for _ in $(seq 200); do
        p=$((10000 + RANDOM % PORT_SPAN))
        if ! port_busy "$p" && ! port_busy $((p + 10000)) && [[ ! -e "$DIR/$p.pid" ]]; then
            echo "$p"
            return 0
        fi
    done
    die "no free port found"
}

cli() { redis-cli -h 127.0.0.1 -p "$1" ${PASSWORD:+-a "$PASSWORD" --no-auth-warning} "${@:2}"; }

stop_dir() {
    local dir="$1" pid pids=()
    for f in "$dir"/*.pid; do
        [[ -e "$f" ]] || continue
        pid="$(cat "$f" 2>/dev/null || true)"
        # Only our own servers: the pid must still be a redis-server.
        if [[ -n "$pid" ]] && grep -q redis-server "/proc/$pid/cmdline" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    for pid in "${pids[@]}"; do
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
    rm -rf "$dir"
}

start() {
    command -v redis-server >/dev/null || die "redis-server not found (run scripts/setup.sh)"
    command -v redis-cli >/dev/null || die "redis-cli not found (run scripts/setup.sh)"
    DIR="${1:-$(mktemp -d -t kvoffload-redis.XXXXXX)}"
    mkdir -p "$DIR"
    DIR="$(cd "$DIR" && pwd)"
    trap 'stop_dir "$DIR"' EXIT
    local n=$((MASTERS * (1 + REPLICAS))) ports=() p
    for _ in $(seq "$n"); do
        p="$(free_port)"
        touch "$DIR/$p.pid"
        redis-server --port "$p" --bind 127.0.0.1 --protected-mode no \
            --daemonize yes --pidfile "$DIR/$p.pid" --logfile "$DIR/$p.log" --dir "$DIR" \
            --cluster-enabled yes --cluster-config-file "nodes-$p.conf" \
            --cluster-node-timeout "$NODE_TIMEOUT" --cluster-require-full-coverage no \
            --save "" --appendonly no \
            --maxmemory "$MAXMEMORY" --maxmemory-policy allkeys-lru \
            ${PASSWORD:+--requirepass "$PASSWORD" --masterauth "$PASSWORD"}
        ports+=("$p")
    done
    for p in "${ports[@]}"; do
        # Generous waits: a loaded CI machine can take seconds to start a server.
        for _ in $(seq 400); do
            [[ "$(cli "$p" ping 2>/dev/null)" == "PONG" ]] && break
            sleep 0.05
        done
        if [[ "$(cli "$p" ping 2>/dev/null)" != "PONG" ]]; then
            tail -n 5 "$DIR/$p.log" >&2 || true
            die "server on port $p did not start"
        fi
    done
    local nodes=()
    for p in "${ports[@]}"; do nodes+=("127.0.0.1:$p"); done
    redis-cli ${PASSWORD:+-a "$PASSWORD" --no-auth-warning} --cluster create "${nodes[@]}" \
        --cluster-replicas "$REPLICAS" --cluster-yes >"$DIR/create.log" 2>&1 \
        || die "cluster create failed (see $DIR/create.log)"
    for p in "${ports[@]}"; do
        for _ in $(seq 600); do
            cli "$p" cluster info 2>/dev/null | grep -q "cluster_state:ok" && break
            sleep 0.05
        done
        cli "$p" cluster info | grep -q "cluster_state:ok" || die "node $p never reached cluster_state:ok"
    done
    # Replicas must hold their master's data before anyone counts on a failover.
    for p in "${ports[@]}"; do
        cli "$p" info replication | grep -q "^role:slave" || continue
        for _ in $(seq 600); do
            cli "$p" info replication | grep -q "^master_link_status:up" && break
            sleep 0.05
        done
        cli "$p" info replication | grep -q "^master_link_status:up" || die "replica $p never synced"
    done
    trap - EXIT
    local auth="" seeds=()
    [[ -n "$PASSWORD" ]] && auth=":$PASSWORD@"
    for p in "${ports[@]:0:$MASTERS}"; do seeds+=("redis://${auth}127.0.0.1:$p"); done
    echo "REDIS_CLUSTER_DIR=$DIR"
    echo "REDIS_CLUSTER_URL=$(IFS=,; echo "${seeds[*]}")"
}

case "${1:-}" in
    start) start "${2:-}" ;;
    stop)
        [[ -n "${2:-}" && -d "$2" ]] || die "usage: $0 stop DIR"
        stop_dir "$2"
        ;;
    *) die "usage: $0 start [DIR] | stop DIR" ;;
esac
