#!/usr/bin/env bash
# tinker-cookbook 0.6.1's supervised recipe, recipes/sl_basic.py (supervised/train.py's loop),
# unmodified, against `meshrl serve` on the packaged SmolLM2-135M-Instruct. Its default data set
# (HuggingFaceH4/no_robots) needs the hub, so the command line swaps in the recipe's documented
# alternative, FromConversationFileBuilder on the cookbook's bundled example_data/conversations.jsonl
# (128 conversations; 16 held out, scored every eval_every steps by its SamplerNLLEvaluator through
# compute_logprobs). Installs the cookbook, starts the server on a free port, runs the recipe,
# stops the server by its PID, prints the NLL per step and exits 2 if it did not fall.
#
#   bash scripts/cookbook/run_sl.sh                      # 3 epochs x 7 steps, ~3-5 min
#   SL_EPOCHS=2 SL_LR=2e-4 bash scripts/cookbook/run_sl.sh [more recipe args]
source "$(dirname "$0")/common.sh"

LOG_DIR="$WORKDIR/sl-$(date +%Y%m%d-%H%M%S)"
DATA="$DEPS/tinker_cookbook/example_data/conversations.jsonl"
start_server
cd "$WORKDIR"   # the tokenizer directory named $MODEL is here
log "sl_basic.py -> $LOG_DIR"
t0=$SECONDS
"$PY" -m tinker_cookbook.recipes.sl_basic \
    model_name="$MODEL" base_url="$BASE_URL" log_path="$LOG_DIR" \
    dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder \
    dataset_builder.file_path="$DATA" dataset_builder.test_size=16 \
    dataset_builder.common_config.model_name_for_tokenizer="$MODEL" \
    dataset_builder.common_config.renderer_name=qwen3_instruct \
    dataset_builder.common_config.max_length=2048 \
    dataset_builder.common_config.batch_size="${SL_BATCH_SIZE:-16}" \
    num_epochs="${SL_EPOCHS:-3}" learning_rate="${SL_LR:-5e-4}" eval_every="${SL_EVAL_EVERY:-5}" \
    "$@" >"$LOG_DIR.out" 2>&1 </dev/null || { log "the recipe failed; the end of $LOG_DIR.out:"; tail -40 "$LOG_DIR.out"; exit 1; }
log "the recipe finished in $((SECONDS - t0)) s (its output: $LOG_DIR.out)"
stop_server
"$PY" "$ROOT/scripts/cookbook/summarize.py" sl "$LOG_DIR"
