#!/usr/bin/env bash
# Install tinker-cookbook 0.6.1 for running its recipes against `meshrl serve`, without touching
# the dependency set of meshrl's own venv: the cookbook and the few packages its supervised and RL
# code paths import that .venv lacks go into a separate directory ($COOKBOOK_DEPS, default
# .venv/cookbook) with --no-deps; the recipes run with .venv's Python and PYTHONPATH=$COOKBOOK_DEPS.
#
# tinker-cookbook is installed with --no-deps because it requires tml-renderers, which the package
# registry does not have; only the Inkling and Kimi-K3 model families import it (see docs/cookbook.md).
# Everything else it declares is already in .venv (torch, transformers, tinker, numpy, ...), except
# the pinned list below. Idempotent: a stamp keyed on this file skips a second run.
#
#   bash scripts/cookbook/setup.sh          # needs .venv (bash scripts/setup.sh)
#   COOKBOOK_WHEEL=/path/tinker_cookbook-0.6.1-py3-none-any.whl bash scripts/cookbook/setup.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${MESHRL_VENV:-.venv}
DEPS=${COOKBOOK_DEPS:-$VENV/cookbook}
COOKBOOK=${COOKBOOK_WHEEL:-tinker-cookbook==0.6.1}
STAMP_KEY=$( (cat scripts/cookbook/setup.sh; echo "$COOKBOOK") | sha1sum | cut -c1-16)
STAMP="$DEPS/.cookbook-setup-$STAMP_KEY"

log() { echo "[cookbook-setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
    log "no $VENV: run 'bash scripts/setup.sh' first"; exit 1
fi

if [ -f "$STAMP" ]; then
    log "up to date ($DEPS)"
else
    log "installing $COOKBOOK and its missing requirements into $DEPS (--no-deps)"
    rm -rf "$DEPS"
    # The packages the cookbook's supervised and RL paths import that .venv lacks, with their own
    # missing requirements; the versions a resolver picks over .venv's set (pip install --dry-run).
    #   chz: every config; blobfile: data and checkpoint files; pyrage: checkpoint_utils;
    #   datasets (+ pandas, multiprocess): supervised.data and math_rl's math_env (imported even
    #   for env=arithmetic); lxml, pycryptodomex: blobfile's;
    #   math-verify, latex2sympy2_extended, antlr4-python3-runtime, pylatexenc: math_rl's grader
    #   (the math-rl extra), imported by recipes/math_rl/train.py.
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$DEPS" \
        "$COOKBOOK" \
        chz==0.4.0 blobfile==3.3.0 pyrage==1.4.0 \
        datasets==5.2.0 pandas==3.1.1 multiprocess==0.70.19 \
        lxml==6.1.3 pycryptodomex==3.24.2 \
        math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 pylatexenc==2.11
    touch "$STAMP"
fi

log "checking imports"
PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import tinker_cookbook.rl.train, tinker_cookbook.supervised.train  # noqa: F401
import tinker_cookbook.recipes.math_rl.train, tinker_cookbook.recipes.sl_basic  # noqa: F401
print("[cookbook-setup] tinker-cookbook", md.version("tinker-cookbook"), "with tinker", md.version("tinker"),
      "imports: rl.train, supervised.train, recipes.math_rl.train, recipes.sl_basic")
EOF
