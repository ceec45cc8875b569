# Every target does its own set-up on a fresh machine: a virtual environment in .venv, torch pinned to the CPU
# wheel (a bare `torch` requirement would pull several GB of CUDA packages), then the package in editable mode.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/symgraph demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

clean:
	rm -rf $(VENV) out
