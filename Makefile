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

# make fuzz: the C++ extensions built with AddressSanitizer + UBSan into FUZZ_DIR (the normal
# build is untouched; `rm -rf build/fuzz` forces a rebuild), then atheris fuzzes every decoder for
# FUZZ_SECONDS (docs/reliability.md); -keep_seed=1 keeps every seed of tests/fuzz_corpus (the hostile
# Bloom filters among them) in the corpus, though their Python coverage matches other seeds'.
FUZZ_SECONDS ?= 300
FUZZ_DIR     ?= build/fuzz
FUZZ_RSS_MB  ?= 2048

.PHONY: help setup demo test bench clean-build fuzz

help:
	@echo "make setup        install everything into .venv (OS packages, torch, TF, patched Horovod, deepreduce)"
	@echo "make demo         $(NP)-rank horovodrun training of ResNet-20 on scikit-learn digits ($(CONFIG))"
	@echo "make test         run the test suite"
	@echo "make bench        run the benchmarks (python -m deepreduce bench)"
	@echo "make clean-build  remove build outputs of deepreduce itself (keeps .venv and the Horovod wheel cache)"
	@echo "make fuzz         fuzz every decoder with atheris for FUZZ_SECONDS ($(FUZZ_SECONDS)) on ASan+UBSan extensions"

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

fuzz:
	$(PY) -m pip install -q atheris
	DEEPREDUCE_SANITIZE=address,undefined $(PY) setup.py -q build_py --build-lib $(FUZZ_DIR)/lib \
		build_ext --build-lib $(FUZZ_DIR)/lib --build-temp $(FUZZ_DIR)/tmp
	mkdir -p $(FUZZ_DIR)/corpus $(FUZZ_DIR)/artifacts
	runtime="$$($(PY) -c 'import atheris; print(atheris.path())')/asan_with_fuzzer.so"; \
	LD_PRELOAD="$$runtime" ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONPATH=$(FUZZ_DIR)/lib \
	$(PY) tests/fuzz/fuzz_decoders.py -keep_seed=1 -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=$(FUZZ_RSS_MB) \
		-timeout=60 -print_final_stats=1 -artifact_prefix=$(FUZZ_DIR)/artifacts/ $(FUZZ_DIR)/corpus tests/fuzz_corpus

clean-build:
	rm -rf build dist *.egg-info .eggs
	find deepreduce csrc -name '*.so' -delete 2>/dev/null || true
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null || true
	rm -f $(VENV)/.deepreduce-stamps/project $(VENV)/.deepreduce-stamps/tf-ops
