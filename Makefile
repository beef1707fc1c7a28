# One-command set-up: `make demo` runs the Phase 28 labs, `make test` runs the tests,
# `make bench` the benchmarks. Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# PyTorch is installed before the package so that its pin decides the build:
# without a GPU (no nvidia-smi) pip also looks at PyTorch's CPU wheel index, so the default
# install is a CPU build (about 200 MB) rather than a several-GB CUDA build. See README.
TORCH_VERSION   ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_EXTRA     := $(if $(shell command -v nvidia-smi 2>/dev/null),,--extra-index-url $(TORCH_CPU_INDEX))
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
ARTIFACTS ?= artifacts

.PHONY: install install-dev demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "torch==$(TORCH_VERSION)" $(TORCH_EXTRA)
	touch $@

$(VENV)/.base: pyproject.toml $(VENV)/.torch
	$(PIP) -e .
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.base
	$(PIP) -e ".[dev]"
	touch $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev

demo: $(VENV)/.dev
	$(PY) -m minituner pretrain --out $(ARTIFACTS)/base --overwrite
	$(PY) -m minituner generate --base $(ARTIFACTS)/base --prompt "The " --num-samples 3 --max-new-tokens 120
	$(PY) experiments/28-lora-counts/count.py
	$(PY) experiments/28-lora-finetune/lab02.py --base $(ARTIFACTS)/base
	$(PY) experiments/28-qlora-preview/lab03.py --base $(ARTIFACTS)/base
	$(PY) experiments/phase28_report.py

test: $(VENV)/.dev
	$(PY) -m pytest tests

bench: $(VENV)/.dev
	$(PIP) -e ".[dev,bench]"
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) $(ARTIFACTS) .pytest_cache
