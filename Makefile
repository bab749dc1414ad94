# Two commands from a fresh clone: `make train` and `make test`. Both build .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.14.1 torchvision==0.29.1
ARGS    ?=
# pytest-xdist workers: the drills are mostly process start-up, and two at once took a third off
# the suite's wall time on 2 cores (docs/testing.md); tests marked `serial` still run alone.
# loadfile keeps a module on one worker (its module fixtures are made once). Modules go out in
# collection order (tests/e2e, the long ones, first; then tests/unit): xdist's default reorder
# sends the modules with the most tests first, which left the few-test, minute-long drills for
# last, one worker idle beside them. JOBS=0: one process.
JOBS    ?= 2
XDIST   := -n $(JOBS) --dist loadfile --no-loadscope-reorder

.DEFAULT_GOAL := help
.PHONY: help venv train test test-fast test-unit check lint format docs mlflow-ui bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)  ## create .venv and install (torch 2.14.1, torchvision 0.29.1, -e .[dev])

train: $(STAMP)  ## run the default job (experiment=demo); extra overrides: make train ARGS="seed=2"
	$(BIN)/python scripts/train.py $(ARGS)

check: $(STAMP)  ## is resume exact after your edit? your config killed and resumed (ARGS="experiment=smoke ...")
	$(BIN)/python scripts/check.py $(ARGS)

lint: $(STAMP)  ## ruff lint + format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint  ## lint, then the whole test suite (slow multi-process drills included)
	$(BIN)/python -m pytest $(XDIST) $(ARGS)

test-fast: $(STAMP)  ## the suite without the slow multi-process drills
	$(BIN)/python -m pytest $(XDIST) -m "not slow" $(ARGS)

test-unit: $(STAMP)  ## the in-process tests only (tests/unit, not slow): a few minutes
	$(BIN)/python -m pytest $(XDIST) -m "not slow" tests/unit $(ARGS)

docs: $(STAMP)  ## regenerate the docs' generated sections (docs/config.md's identity table)
	$(BIN)/python scripts/gen_docs.py

format: $(STAMP)  ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

mlflow-ui: $(STAMP)  ## the MLflow UI on outputs/mlflow.db; prints the URL of the runs table (port 5000)
	$(BIN)/python scripts/mlflow_ui.py --store $(CURDIR)/outputs/mlflow.db --port 5000

bench: $(STAMP)  ## run both benchmarks at their default sizes (about 10 min; results in outputs/bench/)
	$(BIN)/python scripts/bench_checkpoint.py
	$(BIN)/python scripts/bench_data.py

clean:  ## remove outputs (runs, checkpoints, cache, mlflow.db); keeps .venv
	rm -rf outputs/* multirun
	touch outputs/.gitkeep
