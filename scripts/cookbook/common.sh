# Sourced by run_rl.sh and run_sl.sh: the environment the cookbook recipes run in, and a
# `meshrl serve` started on a free port and stopped by its PID when the script exits.
#
# Environment (all optional):
#   COOKBOOK_BASE_URL  use this running server instead of starting one (then nothing is stopped)
#   COOKBOOK_WORKDIR   where recipes run and log (default runs/cookbook)
#   COOKBOOK_MODEL     the cookbook model name to ask for (default Qwen/Qwen3-4B-Instruct-2507)
#   SERVE_CONFIG       meshrl serve config (default configs/serve.yaml)
#   SERVE_TIMEOUT_S    how long to wait for the server to listen (default 600)

set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

VENV=${MESHRL_VENV:-.venv}
PY="$ROOT/$VENV/bin/python"
DEPS=$(cd "$ROOT" && realpath -m "${COOKBOOK_DEPS:-$VENV/cookbook}")
WORKDIR=$(realpath -m "${COOKBOOK_WORKDIR:-runs/cookbook}")
# The model name the recipes ask for: its renderer (qwen3_instruct) is ChatML, the markup of the
# served SmolLM2-135M-Instruct, and needs no tml-renderers; `meshrl serve` answers to it
# (serve.model_aliases) with the one served model.
MODEL=${COOKBOOK_MODEL:-Qwen/Qwen3-4B-Instruct-2507}
SERVE_CONFIG=${SERVE_CONFIG:-configs/serve.yaml}

export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TINKER_API_KEY=${TINKER_API_KEY:-tml-local} TINKER_TELEMETRY=0

log() { echo "[cookbook] $*"; }

bash "$ROOT/scripts/cookbook/setup.sh"

# The served model's directory (built into the meshrl model cache on first use).
MODEL_DIR=$("$PY" -c "from meshrl.models.provision import resolve_model; print(resolve_model('smollm2-135m-instruct'))")

# tokenizer_utils.get_tokenizer(model_name) loads a local directory of that name when one exists:
# give it the served model's tokenizer under the cookbook model name, in the recipes' working dir.
mkdir -p "$WORKDIR/$(dirname "$MODEL")"
ln -sfn "$MODEL_DIR" "$WORKDIR/$MODEL"

SERVER_PID=""
stop_server() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        log "stopping meshrl serve (pid $SERVER_PID)"
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        if kill -0 "$SERVER_PID" 2>/dev/null; then
            log "meshrl serve (pid $SERVER_PID) still up after 60 s: SIGKILL"
            kill -KILL "$SERVER_PID" 2>/dev/null || true
        fi
    fi
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

start_server() {
    if [ -n "${COOKBOOK_BASE_URL:-}" ]; then
        BASE_URL=$COOKBOOK_BASE_URL
        log "using the running server at $BASE_URL"
        return
    fi
    local slog="$WORKDIR/serve-$(date +%Y%m%d-%H%M%S).log"
    log "starting meshrl serve ($SERVE_CONFIG, port 0 = a free one); log: $slog"
    # port 0: the server picks a free port and announces the URL it listens on
    "$ROOT/$VENV/bin/meshrl" serve -c "$SERVE_CONFIG" --port 0 "serve.tokenizer=$MODEL_DIR" >"$slog" 2>&1 &
    SERVER_PID=$!
    local t0=$SECONDS
    while :; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            log "meshrl serve exited before listening; its log:"; tail -30 "$slog"; SERVER_PID=""; exit 1
        fi
        BASE_URL=$(sed -n 's/^serving at \(http:[^ ]*\).*/\1/p' "$slog" | head -1)
        [ -n "$BASE_URL" ] && break
        if (( SECONDS - t0 > ${SERVE_TIMEOUT_S:-600} )); then
            log "meshrl serve did not listen within ${SERVE_TIMEOUT_S:-600} s"; tail -30 "$slog"; exit 1
        fi
        sleep 2
    done
    log "meshrl serve (pid $SERVER_PID) at $BASE_URL after $((SECONDS - t0)) s"
}
