#!/usr/bin/env bash
# TRL and its datasets dependency as wheels for a lent GPU machine (Python 3.12, no package
# registry there), put beside ../shared/tools/gpu-bundle.sh's third carry folder so that
# `python benchmarks/vs_trl.py --backend hf` can run there. Run from the project root after
# gpu-bundle.sh; on the GPU machine, after `. .gpu3/install.sh`:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu3/bench-wheels/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu3/bench-wheels
[ -d .gpu3 ] || { echo "no .gpu3 here: run ../shared/tools/gpu-bundle.sh first" >&2; exit 2; }
mkdir -p "$out"
# the versions the bench extra installs here (trl 1.16.0 pulls datasets 5.2.0)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform any -d "$out" \
    trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash
du -sh "$out"
