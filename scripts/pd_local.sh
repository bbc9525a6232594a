#!/usr/bin/env bash
# PD disaggregation on one machine: a prefill server, a decode server and sglang-router in front of both.
#   scripts/pd_local.sh [extra moeserve serve flags, given to both servers]
# Environment: PREFILL_PORT (30001), DECODE_PORT (30002), BOOTSTRAP_PORT (8998), ROUTER_PORT (30000),
#   BACKEND (zmq; mooncake where it is installed), PYTHON (python).
# Ctrl-C stops all three. Clients talk to http://127.0.0.1:$ROUTER_PORT (native and OpenAI API).
set -euo pipefail

PYTHON=${PYTHON:-python}
PREFILL_PORT=${PREFILL_PORT:-30001}
DECODE_PORT=${DECODE_PORT:-30002}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
ROUTER_PORT=${ROUTER_PORT:-30000}
BACKEND=${BACKEND:-zmq}

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

wait_healthy() {  # url name pid
    for _ in $(seq 600); do
        if curl -sf "$1/health" >/dev/null; then return 0; fi
        if ! kill -0 "$3" 2>/dev/null; then echo "$2 exited during start-up" >&2; exit 1; fi
        sleep 0.5
    done
    echo "$2 did not become healthy" >&2
    exit 1
}

"$PYTHON" -m moeserve.cli serve --disaggregation-mode prefill --port "$PREFILL_PORT" \
    --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" --disaggregation-transfer-backend "$BACKEND" "$@" &
pids+=($!)
"$PYTHON" -m moeserve.cli serve --disaggregation-mode decode --port "$DECODE_PORT" \
    --disaggregation-transfer-backend "$BACKEND" "$@" &
pids+=($!)
wait_healthy "http://127.0.0.1:$PREFILL_PORT" prefill "${pids[0]}"
wait_healthy "http://127.0.0.1:$DECODE_PORT" decode "${pids[1]}"

"$PYTHON" -m sglang_router.launch_router --pd-disaggregation \
    --prefill "http://127.0.0.1:$PREFILL_PORT" "$BOOTSTRAP_PORT" --decode "http://127.0.0.1:$DECODE_PORT" \
    --host 127.0.0.1 --port "$ROUTER_PORT" &
pids+=($!)
echo "PD ready behind the router: http://127.0.0.1:$ROUTER_PORT (prefill :$PREFILL_PORT, decode :$DECODE_PORT)"
wait -n
