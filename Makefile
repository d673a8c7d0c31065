# deepreduce developer entry points. `make setup` is idempotent: run it as often as you like.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV    := .venv
PY      := $(VENV)/bin/python
HVDRUN  := $(VENV)/bin/horovodrun
CONFIG  ?= configs/topk_raw.yaml
NP      ?= 2

# Open MPI refuses to start as root without these (harmless for other users).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# Tools installed in the venv (horovodrun, pytest, ...) come first.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: help setup demo test bench clean-build

help:
	@echo "make setup        install everything into .venv (OS packages, torch, TF, patched Horovod, deepreduce)"
	@echo "make demo         $(NP)-rank horovodrun training of ResNet-20 on scikit-learn digits ($(CONFIG))"
	@echo "make test         run the test suite"
	@echo "make bench        run the benchmarks (python -m deepreduce bench)"
	@echo "make clean-build  remove build outputs of deepreduce itself (keeps .venv and the Horovod wheel cache)"

setup:
	@bash scripts/setup.sh

demo: setup
	$(HVDRUN) -np $(NP) -H localhost:$(NP) $(PY) examples/train_torch.py --config $(CONFIG)

# pytest exits 5 when it collects no test at all; that is reported, not treated as a failure.
test: setup
	@if [ ! -d tests ]; then echo "make test: no tests/ directory"; exit 0; fi; \
	rc=0; $(PY) -m pytest -q -p no:cacheprovider tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests"; exit 0; fi; \
	exit $$rc

bench: setup
	$(PY) -m deepreduce bench

clean-build:
	rm -rf build dist *.egg-info .eggs
	find deepreduce csrc -name '*.so' -delete 2>/dev/null || true
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null || true
	rm -f $(VENV)/.deepreduce-stamps/project $(VENV)/.deepreduce-stamps/tf-ops
