# The two commands a newcomer needs:
#   make run    set up and run the default training job (local meshes, packaged model)
#   make test   set up and run the test suite
# and, for the measured figures (docs/benchmarks.md and the README's headline):
#   make bench  rerun the main benchmarks (BENCH_QUICK=1, the default: ~30 min on 2 cores, the
#               ablation's summary rebuilt from its committed runs; BENCH_QUICK=0: their full
#               length, the ablation's runs not yet recorded included: hours) and regenerate the
#               tables from the JSON
# and on a host with CUDA:
#   make gpu-check  run every GPU path once (scripts/gpu_check.py; GPU_CHECK_ARGS=--parts ... picks
#                   some, GPU_CHECK_ARGS=--quick what one GPU runs in 8 minutes) into
#                   benchmarks/results/gpu_check.json
VENV ?= .venv
PYTEST_ARGS ?=
GPU_CHECK_ARGS ?=
BENCH_QUICK ?= 1
ifeq ($(BENCH_QUICK),1)
QUICK := --quick
ABLATION_ARGS ?= --report-only
else
QUICK :=
ABLATION_ARGS ?=
endif

.PHONY: setup run test test-all bench bench-deps gpu-check

setup:
	@bash scripts/setup.sh

run: setup
	$(VENV)/bin/meshrl train

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# the default suite plus the slow end-to-end tests
test-all: setup
	$(VENV)/bin/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

# the `bench` extra (TRL for benchmarks/vs_trl.py); skipped when already installed
bench-deps: setup
	@$(VENV)/bin/python -c "import trl" 2>/dev/null || $(VENV)/bin/python -m pip install -q -e ".[bench]"

# each script writes benchmarks/results/<name>.json; tables.py renders them into README.md
bench: bench-deps
	$(VENV)/bin/python benchmarks/vs_trl.py $(QUICK)
	$(VENV)/bin/python benchmarks/generation.py $(QUICK)
	$(VENV)/bin/python benchmarks/ablation.py $(ABLATION_ARGS)
	$(VENV)/bin/python benchmarks/tables.py

# the GPU battery (scripts/gpu_check.py): on a host with CUDA every GPU path runs (TRL installed first
# for its benchmarks/vs_trl.py part) and benchmarks/results/gpu_check.json names the device and says
# why any part was skipped; on a host without CUDA it says so and runs nothing
gpu-check: setup
	@if nvidia-smi -L >/dev/null 2>&1; then $(MAKE) --no-print-directory bench-deps; fi
	$(VENV)/bin/python scripts/gpu_check.py $(GPU_CHECK_ARGS)
