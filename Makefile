# The two commands a newcomer needs:
#   make run    set up and run the default training job (local meshes, packaged model)
#   make test   set up and run the test suite
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup run test test-all

setup:
	@bash scripts/setup.sh

run: setup
	$(VENV)/bin/meshrl train

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# the default suite plus the slow end-to-end tests
test-all: setup
	$(VENV)/bin/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)
