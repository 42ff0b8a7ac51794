#!/usr/bin/env bash
# tinker-cookbook 0.6.1's RL recipe, recipes/math_rl/train.py, unmodified, on its arithmetic
# environment (no hub data set), against `meshrl serve` on the packaged SmolLM2-135M-Instruct.
# Installs the cookbook (scripts/cookbook/setup.sh), starts the server on a free port, runs the
# recipe through its command line, stops the server by its PID, prints the reward per step and
# exits 2 if the mean reward of the last 5 steps is not above that of the first 5.
#
#   bash scripts/cookbook/run_rl.sh                      # 30 steps, ~10-20 min on 2 CPU cores
#   RL_STEPS=40 RL_LR=3e-4 bash scripts/cookbook/run_rl.sh [more recipe args, e.g. lora_rank=16]
#
# The recipe runs with its own defaults, its loss included (stable_reinforce: the server records
# each sampled sequence's tokens and logprobs for it, see docs/tinker.md).
source "$(dirname "$0")/common.sh"

LOG_DIR="$WORKDIR/rl-$(date +%Y%m%d-%H%M%S)"
start_server
cd "$WORKDIR"   # the tokenizer directory named $MODEL is here
log "math_rl/train.py -> $LOG_DIR"
t0=$SECONDS
"$PY" -m tinker_cookbook.recipes.math_rl.train \
    model_name="$MODEL" base_url="$BASE_URL" log_path="$LOG_DIR" \
    env=arithmetic \
    group_size="${RL_GROUP_SIZE:-8}" groups_per_batch="${RL_GROUPS_PER_BATCH:-8}" \
    max_tokens="${RL_MAX_TOKENS:-8}" max_steps="${RL_STEPS:-30}" learning_rate="${RL_LR:-3e-4}" \
    "$@" >"$LOG_DIR.out" 2>&1 </dev/null || { log "the recipe failed; the end of $LOG_DIR.out:"; tail -40 "$LOG_DIR.out"; exit 1; }
log "the recipe finished in $((SECONDS - t0)) s (its output: $LOG_DIR.out)"
stop_server
"$PY" "$ROOT/scripts/cookbook/summarize.py" rl "$LOG_DIR"
