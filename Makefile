# One virtual environment for everything. torch is pinned to the release the project is tested
# with; TORCH_INDEX picks the wheel index (empty: pip's own configuration, which on Linux is
# PyPI's CUDA build), e.g. `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
VENV ?= .venv
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench format

$(STAMP): pyproject.toml mmferry/preprocess/_patches.c
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m mmferry demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check mmferry tests examples
	$(VENV)/bin/ruff format --check mmferry tests examples

format: $(STAMP)
	$(VENV)/bin/ruff format mmferry tests examples
	$(VENV)/bin/ruff check --fix mmferry tests examples

bench: $(STAMP)
	$(PY) -m mmferry bench
