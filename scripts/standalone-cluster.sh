#!/usr/bin/env bash
# A Spark standalone cluster on loopback, from the pyspark install: 1 master + 2 workers (issue 5).
#
#   scripts/standalone-cluster.sh start     # master spark://127.0.0.1:7077, 2 workers (1 core, 1 GB each)
#   PYSPARK_PYTHON=$(which python) SPARK_LOCAL_IP=127.0.0.1 gradshare demo --master spark://127.0.0.1:7077 --bind 127.0.0.1
#   scripts/standalone-cluster.sh status
#   scripts/standalone-cluster.sh stop
#
# Everything binds to 127.0.0.1. State (pid files, logs, work dirs) lives in $GRADSHARE_CLUSTER_DIR
# (default /tmp/gradshare-standalone). Every wait is bounded; `stop` sends SIGTERM, then SIGKILL after
# 15 s. Environment: SPARK_HOME (default: the installed pyspark), MASTER_PORT (7077), MASTER_UI_PORT
# (8080), WORKERS (2), WORKER_CORES (1), WORKER_MEMORY (1g), PYSPARK_PYTHON (default: the python that
# has pyspark — executors must find torch and numpy there).
set -euo pipefail

STATE=${GRADSHARE_CLUSTER_DIR:-/tmp/gradshare-standalone}
MASTER_PORT=${MASTER_PORT:-7077}
MASTER_UI_PORT=${MASTER_UI_PORT:-8080}
WORKERS=${WORKERS:-2}
WORKER_CORES=${WORKER_CORES:-1}
WORKER_MEMORY=${WORKER_MEMORY:-1g}
WAIT=${WAIT_SECONDS:-60}
PY=${PYSPARK_PYTHON:-$(command -v python3 || command -v python)}
export SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON="$PY"
MASTER_URL="spark://127.0.0.1:${MASTER_PORT}"

die() { echo "standalone-cluster: $*" >&2; exit 1; }

spark_home() {
  if [[ -n "${SPARK_HOME:-}" ]]; then echo "$SPARK_HOME"; return; fi
  "$PY" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))' 2>/dev/null \
    || die "no SPARK_HOME and no pyspark importable by $PY (set PYSPARK_PYTHON to the venv's python)"
}

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {  # wait_for <seconds> <description> <command...>
  local limit=$1 what=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
  echo "  $what: ready"
}

launch() {  # launch <name> <class> <args...>: background JVM with a pid file and a log
  local name=$1; shift
  nohup "$SPARK_CLASS" "$@" >"$STATE/$name.log" 2>&1 </dev/null &
  echo $! >"$STATE/$name.pid"
}

start() {
  local home; home=$(spark_home)
  SPARK_CLASS="$home/bin/spark-class"
  [[ -x "$SPARK_CLASS" ]] || die "$SPARK_CLASS not found or not executable"
  command -v java >/dev/null || die "java not on PATH (Spark needs Java 17+)"
  mkdir -p "$STATE"
  alive "$STATE/master.pid" && die "already running (master pid $(cat "$STATE/master.pid")); stop it first"
  port_open "$MASTER_PORT" && die "port $MASTER_PORT on 127.0.0.1 is in use; set MASTER_PORT"
  echo "starting master $MASTER_URL (logs in $STATE)"
  launch master org.apache.spark.deploy.master.Master --host 127.0.0.1 --port "$MASTER_PORT" \
    --webui-port "$MASTER_UI_PORT"
  if ! wait_for "$WAIT" "master" port_open "$MASTER_PORT"; then
    tail -20 "$STATE/master.log" >&2; stop; die "master did not listen on $MASTER_PORT within ${WAIT}s"
  fi
  for i in $(seq 1 "$WORKERS"); do
    mkdir -p "$STATE/work-$i"
    launch "worker-$i" org.apache.spark.deploy.worker.Worker "$MASTER_URL" --host 127.0.0.1 \
      --cores "$WORKER_CORES" --memory "$WORKER_MEMORY" --work-dir "$STATE/work-$i" --webui-port 0
  done
  for i in $(seq 1 "$WORKERS"); do
    if ! wait_for "$WAIT" "worker $i" grep -q "Successfully registered with master" "$STATE/worker-$i.log"; then
      tail -20 "$STATE/worker-$i.log" >&2; stop; die "worker $i did not register within ${WAIT}s"
    fi
  done
  echo "cluster up: $MASTER_URL, $WORKERS workers x $WORKER_CORES core(s); executors run $PY"
}

stop() {
  local any=0
  for pidfile in "$STATE"/worker-*.pid "$STATE"/master.pid; do
    [[ -f "$pidfile" ]] || continue
    any=1
    local pid; pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      local deadline=$((SECONDS + 15))
      while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.3; done
      if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
      echo "stopped $(basename "$pidfile" .pid) (pid $pid)"
    fi
    rm -f "$pidfile"
  done
  ((any)) || echo "nothing to stop (no pid files in $STATE)"
}

status() {
  local rc=0
  for pidfile in "$STATE"/master.pid "$STATE"/worker-*.pid; do
    [[ -f "$pidfile" ]] || continue
    if alive "$pidfile"; then echo "$(basename "$pidfile" .pid): running (pid $(cat "$pidfile"))"
    else echo "$(basename "$pidfile" .pid): NOT running (stale pid file)"; rc=1; fi
  done
  [[ -f "$STATE/master.pid" ]] || { echo "not started"; rc=1; }
  return $rc
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
