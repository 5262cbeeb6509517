# Shared by the benchmarks/*/run*.sh scripts (source it): start an omni-serve server in the background
# and wait until its /health answers.
#   start_server LOG ARGS...   -> sets SERVER (pid); exits the script if the server dies while starting
start_server() {
  local log=$1; shift
  "$BIN/omni-serve" serve --port "$PORT" "$@" > "$log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
  echo "waiting for the server (log: $log) ..."
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
    kill -0 "$SERVER" 2>/dev/null || { echo "server exited; see $log"; exit 1; }
    sleep 2
  done
  echo "the server did not become healthy in 240 s; see $log"; exit 1
}
