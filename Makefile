# Two commands: `make compare` (the main job) and `make test`. Both set up .venv first.
# `make peers` (opt-in) builds llama.cpp for the llama.cpp peer backend (scripts/build_llamacpp.sh).
# `make clients` (opt-in) installs third-party clients the server tests run: lm-evaluation-harness in
# .venv; the benchmark clients aiperf and guidellm, and TGI's text-generation client, each in a venv of its own
# (their pins clash with ours).
# `make triton` (opt-in) installs NVIDIA Triton Inference Server (the one nvidia-pytriton's wheel bundles) and
# Triton's client, tritonclient, in .venv-triton (it pins numpy<2): what `mqa-triton` runs and its tests drive.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
# DeepSpeed JIT-compiles its CPU shared-memory all-reduce with g++ + ninja; keep the build cache in the repo.
# Setup compiles our CPU kernels there (every one this CPU runs, side by side), so no first run waits for g++.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test compare bench-hf peers clients triton clean
setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@command -v g++ >/dev/null || (apt-get update -qq && apt-get install -y -qq g++)
	@test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m plugins.kernels --build >/dev/null
	@touch $(STAMP)

# The whole suite on this CPU's own kernel rung (implementations chosen by timing them here), in
# TEST_WORKERS pytest-xdist workers, each taking whole files (a file's module fixtures, a server or a
# TP world, start once), then the kernel tests again with each lower rung forced and the ladder's fixed
# choices (plugins/kernels), so one machine covers the paths of every CPU in the pool. The kernel
# timings the suite reads (every kind at this machine's thread count; bf16 at one thread, as TP ranks
# and replicas run) are taken first, while nothing else runs: timed beside the tests they would be
# noise (and are not kept if something else did run: plugins/kernels/measure.py). The workers share
# the cores, so idle OpenMP threads sleep instead of spinning (libgomp's default spin takes the core
# another worker's process waits for).
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m plugins.kernels >/dev/null
	OMP_NUM_THREADS=1 $(PY) -m plugins.kernels --kind bf16 >/dev/null
	OMP_WAIT_POLICY=passive $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests
	@for rung in $$($(PY) -m plugins.kernels --lower-rungs); do \
		echo "== kernel tests with PLUGINS_KERNELS=$$rung"; \
		PLUGINS_KERNELS=$$rung PLUGINS_KERNELS_TABLE=static $(PY) -m pytest -q -m kernels tests || exit 1; \
	done

compare: setup
	$(PY) scripts/compare.py

# Idempotent: the script returns at once when its build is there.
peers: setup
	PY=$(CURDIR)/$(PY) scripts/build_llamacpp.sh

clients: $(VENV)/.clients-done .venv-aiperf/.done .venv-guidellm/.done .venv-tgi/.done

triton: .venv-triton/.done

$(VENV)/.clients-done: requirements-clients.txt $(STAMP)
	$(PY) -m pip install -q -r requirements-clients.txt
	@touch $@

.venv-%/.done: requirements-%.txt
	@test -x .venv-$*/bin/python || python3.11 -m venv .venv-$* || python3 -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q -r $<
	@touch $@

clean:
	rm -rf $(VENV) .venv-aiperf .venv-guidellm .venv-tgi .venv-triton .cache results checkpoints
