# The two commands a newcomer needs:
#   make run    set up and run the default training job (local meshes, packaged model)
#   make test   set up and run the test suite
# and, for the measured figures (docs/benchmarks.md and the README's headline):
#   make bench  rerun the main benchmarks (BENCH_QUICK=1, the default: ~30 min on 2 cores, the
#               ablation's summary rebuilt from its committed runs; BENCH_QUICK=0: their full
#               length, the ablation's runs not yet recorded included: hours) and regenerate the
#               tables from the JSON
VENV ?= .venv
PYTEST_ARGS ?=
BENCH_QUICK ?= 1
ifeq ($(BENCH_QUICK),1)
QUICK := --quick
ABLATION_ARGS ?= --report-only
else
QUICK :=
ABLATION_ARGS ?=
endif

.PHONY: setup run test test-all bench bench-deps

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
