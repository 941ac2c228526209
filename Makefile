# Two commands do everything on a fresh machine with Python 3.10+:
#   make pilot   run the pilot notebooks on the default sample task into a new runs/ folder
#   make test    lint, unit tests, notebook regression (papermill) and nbval
# Each creates .venv if missing, installs the project and registers the `workbook` kernel.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CI pins the small CPU build (TORCH=torch==2.13.0); by default pip picks a build for your machine.
TORCH ?= torch>=2.6
STAMP := $(VENV)/.installed
PILOT_ARGS ?=

.PHONY: install pilot test lint lab bench samples clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m ipykernel install --sys-prefix --name workbook --display-name "Python (workbook)"
	touch $(STAMP)

install: $(STAMP)

pilot: $(STAMP)
	$(BIN)/python -m workbook pilot $(PILOT_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check workbook tests notebooks benchmarks data_samples tools

test: lint
	$(BIN)/python -m pytest tests notebooks --nbval --nbval-kernel-name workbook \
		--nbval-sanitize-with tests/nbval_sanitize.cfg

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks

bench: $(STAMP)
	$(BIN)/python benchmarks/loop_overhead.py

samples:
	$(PYTHON) data_samples/make_samples.py

clean-venv:
	rm -rf $(VENV)
