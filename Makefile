# One entry point for people and CI. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint check bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: install  ## the whole fleet on embedded defaults (private Valkey, simulator, 2 workers)
	$(BIN)/specfleet demo

test: install  ## every test, on a private Valkey and real celery worker processes
	$(BIN)/python -m pytest

lint: install  ## ruff and mypy on the packages
	$(BIN)/ruff check common workers producer simulator tests bench demo ops
	$(BIN)/mypy

check: lint test  ## every check CI runs

bench: install  ## benchmark scripts that print figures
	$(BIN)/python bench/enqueue.py
	$(BIN)/python bench/rebuild_throughput.py
	$(BIN)/python bench/fleet_run.py --prompts 10000 --in-flight 2000
	$(BIN)/python bench/mismatch_run.py --prompts 10000
	$(BIN)/python bench/throttle_run.py --prompts 12000 --workers 3 --greenlets 500 --capacity 300

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache
