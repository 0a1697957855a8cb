# Two entry points: `make serve` and `make test`. Both create .venv when missing
# and install the pinned dependencies and this project into it first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 30000
# the suite runs on two worker processes (a file per worker at a time: module fixtures are built once)
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: setup serve test bench-offline clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install "triton==3.6.0" "numpy<2.4"
	$(PIP) install -e ".[test]"
	touch $(STAMP)

serve: $(STAMP)
	$(PY) server.py --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench-offline: $(STAMP)
	$(PY) bench/bench_offline.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
