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

.PHONY: setup serve test test-sglang bench-offline clean

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

# The SGLang plugin's tests: sglang==0.5.23 and the packages its imports need, all --no-deps so
# that SGLang's torch==2.14.1 pin never replaces ours (tests/sglang-requirements.txt).
SGLANG_STAMP := $(VENV)/.sglang-installed
$(SGLANG_STAMP): $(STAMP) tests/sglang-requirements.txt
	$(PIP) install --no-deps -r tests/sglang-requirements.txt
	touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	$(PY) -m pytest tests/test_sglang_adapter.py $(PYTEST_ARGS)

bench-offline: $(STAMP)
	$(PY) bench/bench_offline.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
