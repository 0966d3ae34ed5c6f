# suite: `make help` lists the targets.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .cache/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-8)

.PHONY: help install demo test test-fast lint format bench bench-gpu bench-parallel clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,deploy,harness]"
	@mkdir -p .cache && touch $(STAMP)

install: $(STAMP) ## install torch (CPU build) first, then the suite with its dev, deploy and harness extras (editable)

demo: $(STAMP) ## train gpt-tiny on the embedded corpus on this machine, then sample from it
	suite pretrain
	suite generate ckpt=runs/gpt-tiny prompt="The module"

# Two pytest workers, one test file each at a time: single-process tests leave a core idle (torch's import
# and OMP_NUM_THREADS=1 runs are single-threaded), and a file's shared runs stay in one worker; the
# longest files start first (tests/conftest.py LONGEST_FIRST), not the files with the most tests.
TEST_WORKERS ?= 2

test: $(STAMP) ## run every test (unit, distributed, e2e); TEST_WORKERS=0 runs them in one process
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

test-fast: $(STAMP) ## unit tests only
	$(PYTHON) -m pytest -q tests/unit

lint: $(STAMP) ## ruff lint and format check
	$(PYTHON) -m ruff check suite tests bench
	$(PYTHON) -m ruff format --check suite tests bench

format: $(STAMP) ## apply ruff's formatting and safe fixes
	$(PYTHON) -m ruff check --fix suite tests bench
	$(PYTHON) -m ruff format suite tests bench

bench: $(STAMP) ## CPU benchmark against plain transformers; appends to docs/benchmarks.md
	$(PYTHON) bench/throughput.py

bench-gpu: $(STAMP) ## one CUDA GPU: tokens/s, MFU, memory of gpt345m/gpt1.3b/llama3-8b (fewer layers), each option on/off; appends to docs/benchmarks.md
	$(PYTHON) bench/gpu.py --append

bench-parallel: $(STAMP) ## parallel layouts at world size 4 on CPU: step time, per-rank memory; appends to docs/benchmarks.md
	$(PYTHON) bench/parallel.py --append

clean: ## remove runs, caches and build outputs
	rm -rf runs .cache build dist *.egg-info .pytest_cache .ruff_cache
