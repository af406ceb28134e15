# One virtual environment for everything; torch is pinned to the CPU build kept on this disk.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench format

$(STAMP): pyproject.toml mmferry/preprocess/_patches.c
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m mmferry demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check mmferry tests bench examples
	$(VENV)/bin/ruff format --check mmferry tests bench examples

format: $(STAMP)
	$(VENV)/bin/ruff format mmferry tests bench examples
	$(VENV)/bin/ruff check --fix mmferry tests bench examples

bench: $(STAMP)
	$(PY) -m mmferry bench
